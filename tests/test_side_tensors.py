"""Side tensors (DeepStack features) across pipeline stages: packing with the hidden states, and the toy family of
``toy_deepstack.py`` split at every kind of boundary against the whole model in one stage (the oracle)."""
from __future__ import annotations

import pytest
import torch

from megatron.vlm.stage.side import live_at, pack, unpack
from omnibal_ext.model.spec import SideTensor


def test_pack_unpack_round_trip_views_and_gradients():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 2, 3, generator=g, requires_grad=True)
    a = torch.randn(4, 3, generator=g, requires_grad=True)
    b = torch.randn(1, 7, generator=g, requires_grad=True)
    packed = pack(hidden, [a, b])
    # 12 + 7 = 19 values beside 5 x 2 x 3: ceil(19 / 6) = 4 more rows of [2, 3], 5 values of padding
    assert packed.shape == (9, 2, 3)
    received = packed.detach().requires_grad_()
    h, (a2, b2) = unpack(received, [(4, 3), (1, 7)])
    assert torch.equal(h, hidden) and torch.equal(a2, a) and torch.equal(b2, b)
    for t in (h, a2, b2):  # views of the received buffer, no copy
        assert t.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
    (h.sum() * 2 + (a2 * 3).sum() + (b2 * 4).sum()).backward()
    packed.backward(received.grad)
    assert torch.equal(hidden.grad, torch.full_like(hidden, 2.0))
    assert torch.equal(a.grad, torch.full_like(a, 3.0)) and torch.equal(b.grad, torch.full_like(b, 4.0))
    assert pack(hidden, []) is hidden and unpack(received, [])[0] is received


def test_live_at_boundaries():
    sides = (SideTensor("x", 2, (7,), 8), SideTensor("y", 3, (5, 9), 8))
    assert live_at(sides, 2) == ()  # produced by unit 2: not before the boundary before it
    assert [s.name for s in live_at(sides, 3)] == ["x"]
    assert [s.name for s in live_at(sides, 6)] == ["x", "y"]
    assert [s.name for s in live_at(sides, 8)] == ["y"]
    assert live_at(sides, 10) == ()


@pytest.fixture
def toy(megatron_world):
    import toy_deepstack

    toy_deepstack.register()
    try:
        yield toy_deepstack
    finally:
        toy_deepstack.unregister()


def _batch(spec, img_context_id):
    """Two samples: 3 tiles then a text-only one (a dummy tile), 48 tokens each."""
    from megatron.vlm.data.collate import collate_padded
    from megatron.vlm.stage.micro_batch import MicroBatch

    T, v = spec.tokens_per_tile, spec.vision
    g = torch.Generator().manual_seed(1)
    samples = []
    for tiles in (3, 0):
        ids = torch.randint(0, 256, (48,), generator=g)
        ids[2:2 + tiles * T] = img_context_id
        labels = torch.full((48,), -100)
        labels[30:] = ids[30:]
        samples.append({"input_ids": ids.numpy(), "labels": labels.numpy(),
                        "pixel_values": torch.randn(max(tiles, 1), v.in_channels, v.image_size, v.image_size,
                                                    generator=g),
                        "image_flags": torch.tensor([1] * tiles if tiles else [0], dtype=torch.int64)})
    return MicroBatch.of(collate_padded(samples, pad_id=0))


def _run_split(spec, cuts, batch, trainable=None):
    """The model cut before every unit of ``cuts``: (loss, {unit name.param: grad}), stages chained by hand as
    megatron-core's schedule chains them (each stage's input a leaf that requires grad)."""
    from megatron.vlm.stage.build import StageBuild, build_stage
    from omnibal_ext.model.units import build_units

    units = build_units(spec)
    bounds = [0, *cuts, len(units)]
    stages = [build_stage(StageBuild(spec, range(a, b), pp=len(bounds) - 1, img_context_id=263, seed=3,
                                     trainable=trainable)) for a, b in zip(bounds, bounds[1:])]
    outputs, inputs, x = [], [], None
    for stage in stages:
        if x is not None:
            x = x.detach().requires_grad_()
        inputs.append(x)
        stage.set_input_tensor(x)
        x = stage(batch)
        outputs.append(x)
    real = batch.text.labels != -100
    loss = (x.loss * real).sum()
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        if outputs[k].requires_grad:
            outputs[k].backward(inputs[k + 1].grad)
    grads = {}
    for stage in stages:
        for unit, module, _ in stage.unit_modules():
            for name, p in module.named_parameters():
                grads[f"{unit.name}.{name}"] = p.grad
    return loss.detach(), grads, stages


@pytest.mark.parametrize("cuts", [(3, 8), (4, 7), (2, 5, 9)])
def test_split_stages_equal_the_whole_model(toy, cuts):
    """Boundaries inside the ViT (a feature crossing ViT -> ViT), between ViT and LLM, inside the LLM (two live
    features, one consumed on the stage that receives it, one passed on): loss and every gradient as one stage."""
    spec = toy.toy_spec()
    batch = _batch(spec, 263)
    whole_loss, whole, _ = _run_split(spec, (), batch)
    merger = [k for k in whole if "side_merger" in k]
    assert len(merger) == 4 and all(whole[k] is not None and whole[k].abs().sum() > 0 for k in merger)
    loss, grads, stages = _run_split(spec, cuts, batch)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == whole.keys()
    for k in whole:
        torch.testing.assert_close(grads[k], whole[k], rtol=1e-5, atol=1e-7, msg=k)
    assert any(s.sides_out for s in stages)


def test_side_changes_the_loss(toy):
    """The feature is really added: zeroing a merger changes the loss (the test above could not fail otherwise)."""
    spec = toy.toy_spec()
    batch = _batch(spec, 263)
    from megatron.vlm.stage.build import StageBuild, build_stage
    from omnibal_ext.model.units import build_units

    stage = build_stage(StageBuild(spec, range(len(build_units(spec))), img_context_id=263, seed=3))
    before = stage(batch).loss.sum()
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if "side_merger" in name:
                p.zero_()
    assert abs(float(stage(batch).loss.sum() - before)) > 1e-4


def test_frozen_vit_trains_its_mergers(toy):
    """--freeze-vit: the ViT's weights get no gradient, the mergers (the projector's role) do, split or whole."""
    from omnibal_ext.model.trainable import Freeze
    from omnibal_ext.model.units import build_units

    spec = toy.toy_spec()
    batch = _batch(spec, 263)
    trainable = Freeze(vit=True).trainable(build_units(spec)).trains
    whole_loss, whole, _ = _run_split(spec, (), batch, trainable)
    loss, grads, _ = _run_split(spec, (3, 8), batch, trainable)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-6)
    for k, g in whole.items():
        if k.startswith("vit.") and "side_merger" not in k:
            assert g is None and grads[k] is None, k
        else:
            assert g is not None and g.abs().sum() > 0, k
            torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-7, msg=k)


def test_profiler_runs_a_side_tensor_family(toy):
    """The trainer's profiler (a model of one layer of each kind: no DeepStack feature in it) measures the toy and
    adds the features' boundary bytes from the whole spec."""

    from megatron.training.flags import build_parser
    from megatron.training.profiling import profile_units
    from megatron.training.specs import run_config
    from omnibal_ext.model.cost_model import MicroBatchShape
    from omnibal_ext.model.side_bytes import boundary_side_bytes

    spec, shape = toy.toy_spec(), MicroBatchShape(2, 64, 4)
    config = run_config(build_parser().parse_args(["--seed", "3", "--transformer-impl", "local"]), 1)
    table = profile_units(config, spec, shape, 263, torch.device("cpu"), warmup=0, repeats=1)
    assert [u.side_send_bytes for u in table.units] == boundary_side_bytes(spec, shape)
    assert table.units[3].side_send_bytes == 2 * 2 * 4 * 64 * 4  # both features, 2 tiles x 4 tokens, fp32
