"""Per-unit parameter seeds: a unit's weights come from (seed, unit index), whichever stage builds it.

megatron's CPU initialisation draws the full matrix before splitting it over TP, so a unit drawn from its
own seed has the same weights at every TP size and layout: parallel runs reproduce the serial run.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


def unit_seed(seed: int, unit_index: int) -> int:
    return (seed * 1_000_003 + 7919 * (unit_index + 1)) % (2**31 - 1)


@contextlib.contextmanager
def seeded(seed: int, unit_index: int):
    """Draw a unit's parameters from its own seed, leaving the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, unit_index))
        yield


class SeededTransformerLayer(TransformerLayer):
    """A TransformerLayer whose weights are drawn from a generator seeded by its unit index.

    redraw: called as ``redraw(layer, config)`` after megatron's initialisation, again from the unit's seed,
    when a family draws some weights its own way (padded ViT heads: ``megatron/vlm/parallel/padded_heads.py``).
    LoRA linears (``megatron/vlm/layers/lora.py``) then draw their adapters for the unit (``draw_adapter``).
    """

    def __init__(self, config, submodules, layer_number=1, seed=0, first_unit_index=0, redraw=None, **kwargs):
        unit = first_unit_index + layer_number - 1
        with seeded(seed, unit):
            super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        if redraw is not None:
            with seeded(seed, unit):
                redraw(self, config)
        for module in self.modules():
            if hasattr(module, "draw_adapter"):
                module.draw_adapter(seed, unit)
