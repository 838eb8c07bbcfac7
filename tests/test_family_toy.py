"""Adding a model family is a path: a toy family defined entirely here, through the public registration of
both sides, serves the planners (unit list, analytic costs, layout parser) and the trainer's stage.

The toy is InternVL with another projector: one linear layer (pixel shuffle, then a single Linear into the
LLM's width) instead of LayerNorm and a 2-layer MLP.  Its planning side is a ``Family`` with its own
``ProjectorCost`` subclass, registered by ``omnibal_ext.model.families.register``; its runtime side a ``RuntimeFamily``
with its own projector component in ``megatron.vlm.families``; everything else is InternVL's and the shared
GPT decoder's.
"""
from __future__ import annotations

import pytest
import torch

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs, unit_param_counts
from omnibal_ext.model.families import Family
from omnibal_ext.model.families.internvl import ProjectorCost, VisionEmbedCost, VisionLayerCost, VisionSpec
from omnibal_ext.model.spec import PROJECTOR, TEXT_EMBED
from omnibal_ext.model.units import build_units, get_preset

TOY = "toy-linear-projector"


class LinearProjectorCost(ProjectorCost):
    """Pixel shuffle and one Linear (with bias) into the LLM's width."""

    kind = "linear_projector"

    def flops(self, shape, tp):
        hi, ho = self.spec.projector_in_size, self.spec.language.hidden_size
        return 2.0 * self._image_tokens(shape) * hi * ho, 0.0

    def params(self, tp):
        return self.spec.projector_in_size * self.spec.language.hidden_size + self.spec.language.hidden_size


def toy_unit_list(spec):
    units = [("vit.embed", VisionEmbedCost, None)]
    units += [(f"vit.layer.{i}", VisionLayerCost, i) for i in range(spec.vision.num_layers)]
    units += [("projector", LinearProjectorCost, None), ("llm.embed", TextEmbedCost, None)]
    units += [(f"llm.layer.{i}", TextLayerCost, i) for i in range(spec.language.num_layers)]
    return units + [("llm.head", HeadCost, None)]


def toy_spec():
    return get_preset("tiny").replace(name="toy", family=TOY)


@pytest.fixture
def toy_family():
    """Both sides of the toy family registered for the test, unregistered after it."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import MegatronModule

    from megatron.vlm import families as runtime
    from megatron.vlm.components import GPT_DECODER, RuntimeComponent, RuntimeFamily
    from megatron.vlm.config import vision_config
    from megatron.vlm.families.internvl.components import VisionEmbed, VisionLayer

    class LinearProjector(MegatronModule):
        """[1 + P, n, Hv] -> drop the class token -> pixel shuffle -> Linear -> [n * tokens per tile, 1, Hl]."""

        def __init__(self, spec, config):
            super().__init__(config=config)
            self.grid = int(round(spec.vision.patches_per_tile ** 0.5))
            self.factor = int(round(1 / spec.downsample_ratio))
            self.fc = tensor_parallel.ColumnParallelLinear(
                spec.projector_in_size, spec.language.hidden_size, config=config, init_method=config.init_method,
                bias=True, gather_output=True)

        def forward(self, vit_out):
            x = vit_out[1:].transpose(0, 1)
            n, _, h = x.shape
            g, f = self.grid, self.factor
            x = x.reshape(n, g // f, f, g // f, f, h).permute(0, 1, 3, 2, 4, 5).reshape(n * (g // f) ** 2, f * f * h)
            x, _ = self.fc(x)
            return x.unsqueeze(1)

    class LinearProjectorUnit(RuntimeComponent):
        cost, attr = LinearProjectorCost, "projector"

        def build(self, units):
            return LinearProjector(self.spec, self.ctx.language_config)

        def forward(self, module, x, batch, cache):
            return module(x)

    plan = Family(
        name=TOY, vision_spec=VisionSpec,
        components=(VisionEmbedCost, VisionLayerCost, LinearProjectorCost, TextEmbedCost, TextLayerCost, HeadCost),
        unit_list=toy_unit_list, vision_item="tile")
    runtime.register(RuntimeFamily(planning=plan, components=(VisionEmbed, VisionLayer, LinearProjectorUnit,
                                                              *GPT_DECODER), vision_config=vision_config))
    try:
        yield
    finally:
        runtime.unregister(TOY)


def test_toy_family_plans_and_builds(megatron_world, toy_family):
    from omnibal_ext.model.layout import parse_layout

    from megatron.vlm.families import stage_inputs
    from megatron.vlm.stage import StageBuild, build_stage

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
    assert stage_inputs(spec, [units[i] for i in first]).pixels
    assert not stage_inputs(spec, [units[i] for i in second]).pixels

    # forward and backward, whole and split at the projector: the same loss and gradients
    batch = _batch(spec)
    out = stage(batch)
    real = batch["labels"] != -100
    (out.loss * real).sum().backward()
    assert torch.isfinite(out.loss).all() and out.correct.shape == batch["labels"].shape
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

    from megatron.vlm.stage import StageBuild, build_stage

    with pytest.raises(UserError, match="family"):
        build_stage(StageBuild(toy_spec(), range(3)))


def _batch(spec):
    """Two tiles in one sample of 96 tokens: text, the image tokens, an answer."""
    from megatron.vlm.data.collate import collate_padded

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
    return collate_padded([sample], pad_id=0)
