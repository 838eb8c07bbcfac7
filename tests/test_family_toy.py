"""Adding a model family is a path: a toy family defined entirely outside the package (``tests/toy_family.py``),
registered through the public ``register``, serves the planners (unit list, analytic costs, layout parser), the
trainer's stage, the HF conversion and the trainer itself (``--family-module``, PP2 with ISF).

The toy is InternVL with another projector (one Linear after the pixel shuffle); see ``toy_family.py``.
"""
from __future__ import annotations

import pytest
import torch

from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs, unit_param_counts
from omnibal_ext.model.spec import PROJECTOR, TEXT_EMBED
from omnibal_ext.model.units import build_units, get_preset

TOY = "toy-linear-projector"


def toy_spec():
    return get_preset("tiny").replace(name="toy", family=TOY)


@pytest.fixture
def toy_family():
    """The toy family (``toy_family.py``, a module outside the package) registered for the test through the
    public ``register`` (the first import registers it; again is a no-op), unregistered after it."""
    import importlib

    from omnibal_ext.model import families

    families.register(importlib.import_module("toy_family").FAMILY)
    try:
        yield
    finally:
        families.unregister(TOY)


def test_toy_family_plans_and_builds(megatron_world, toy_family):
    from omnibal_ext.model.layout import parse_layout

    from megatron.vlm.stage.components import units_inputs
    from megatron.vlm.stage.build import StageBuild, build_stage

    spec = toy_spec()
    units = build_units(spec)
    proj = next(u for u in units if u.code == PROJECTOR)
    assert proj.kind == "linear_projector" and proj.name == "projector"

    # the planning side's parameter counts are the built modules' (the new projector's and every other unit's)
    counts = unit_param_counts(spec, 1)
    table = analytic_costs(spec, MicroBatchShape(2, 96, 4))
    assert table.units[proj.index].param_count == counts[proj.index] == 256 * 64 + 64
    stage = build_stage(StageBuild(spec, range(len(units)), img_context_id=263, seed=3))
    built = {unit.index: sum(p.numel() for p in module.parameters()) for unit, module, _ in stage.unit_modules()}
    assert built[proj.index] == counts[proj.index]
    assert [built[u.index] for u in units] == counts

    # the layout parser takes its units, and a stage built from each slice reads what its units need
    layout = parse_layout("I v*4 P | E t*4 L", spec, 2)
    first, second = range(0, 6), range(6, len(units))
    assert layout.stage_slices() == [first, second]
    assert units_inputs(spec, [units[i] for i in first]).pixels
    assert not units_inputs(spec, [units[i] for i in second]).pixels

    # forward and backward, whole and split at the projector: the same loss and gradients
    batch = _batch(spec)
    out = stage(batch)
    real = batch.text.labels != -100
    (out.loss * real).sum().backward()
    assert torch.isfinite(out.loss).all() and out.correct.shape == batch.text.labels.shape
    grads = {n: p.grad for n, p in stage.named_parameters()}
    assert grads["projector.fc.weight"] is not None and grads["projector.fc.weight"].abs().sum() > 0
    assert all(g is not None for g in grads.values())
    a = build_stage(StageBuild(spec, first, pp=2, img_context_id=263, seed=3))
    b = build_stage(StageBuild(spec, second, pp=2, img_context_id=263, seed=3))
    x = a(batch)
    assert x.shape == (2 * spec.tokens_per_tile, 1, spec.language.hidden_size)
    y = x.detach().requires_grad_()
    b.set_input_tensor(y)
    split = b(batch)
    torch.testing.assert_close(split.loss, out.loss, rtol=0, atol=1e-6)
    (split.loss * real).sum().backward()
    x.backward(y.grad)
    torch.testing.assert_close(a.projector.fc.weight.grad, grads["projector.fc.weight"], rtol=1e-5, atol=1e-6)
    assert b.part(TEXT_EMBED) is not None and a.part(TEXT_EMBED) is None

    # the checkpoint keys are the units' global names
    keys = {v.key for v in stage.sharded_state_dict().values() if hasattr(v, "key")}
    assert {"projector.fc.weight", "projector.fc.bias"} <= keys


def test_unknown_family_is_refused(megatron_world):
    from omnibal_ext.errors import UserError

    from megatron.vlm.stage.build import StageBuild, build_stage

    with pytest.raises(UserError, match="family"):
        build_stage(StageBuild(toy_spec(), range(3)))


def _batch(spec):
    """Two tiles in one sample of 96 tokens: text, the image tokens, an answer."""
    from megatron.vlm.data.collate import collate_padded
    from megatron.vlm.stage.micro_batch import MicroBatch

    n_img = 2 * spec.tokens_per_tile
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (96,), generator=g)
    ids[4:4 + n_img] = 263
    labels = torch.full((96,), -100)
    labels[80:] = ids[80:]
    v = spec.vision
    sample = {"input_ids": ids.numpy(), "labels": labels.numpy(),
              "pixel_values": torch.randn(2, v.in_channels, v.image_size, v.image_size, generator=g),
              "image_flags": torch.ones(2, dtype=torch.int64)}
    return MicroBatch.of(collate_padded([sample], pad_id=0))


def test_toy_family_converts_to_hf_and_back(megatron_world, toy_family, tmp_path):
    """Its HF side (a config reader recognizing its model_type, InternVL's tensor names, the projector's own
    tensors) writes a folder that the registry recognizes as the toy's and that loads back bit for bit."""
    import json

    from safetensors.torch import save_file

    from megatron.vlm.hf.config import HFInfo
    from megatron.vlm.hf.configs import native_config
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.keys import recipes, to_hf
    from megatron.vlm.hf.load import load_hf_into_stage
    from megatron.vlm.stage.build import StageBuild, build_stage

    spec = get_preset("toy-tiny")
    info = HFInfo(layout="native", text_family="llama", vit_layers_in_checkpoint=spec.vision.num_layers,
                  image_token_id=263)
    _, shapes = recipes(spec, info)
    assert {"toy_projector.weight", "toy_projector.bias"} <= set(shapes)
    g = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(hf, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(native_config(spec, info, None)))

    src = HFSource.open(str(folder))
    assert src.spec.family == TOY
    stage = build_stage(StageBuild(src.spec, range(len(build_units(src.spec))), img_context_id=263, seed=3))
    load_hf_into_stage(stage, src)
    assert torch.equal(stage.projector.fc.weight, hf["toy_projector.weight"])
    back = to_hf(src.spec, src.info, src.global_tensors())
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)

