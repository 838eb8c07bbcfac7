"""Side tensors: features that one unit produces and later units read (DeepStack features: made by
a ViT layer's merger, added to an LLM layer's output), held per micro-batch while a stage runs.

Inside a stage they live in the forward's ``cache`` (``put_side`` / ``take_side``).  Across stages they travel
with the hidden states through megatron-core's P2P (``megatron.vlm.stage``); which ones cross a boundary follows
from the planning side's ``SideTensor`` list (``omnibal_ext.model.spec.SideTensor``,
``omnibal_ext.model.families.Family.side_tensors``) and the layout.
"""
from __future__ import annotations

import torch

_SIDE = "side_tensors"


def put_side(cache: dict, name: str, tensor: torch.Tensor) -> None:
    """Hold ``tensor`` as side tensor ``name`` for the rest of this micro-batch's forward (and later stages)."""
    held = cache.setdefault(_SIDE, {})
    if name in held:
        raise ValueError(f"side tensor {name!r} produced twice in one micro-batch")
    held[name] = tensor


def take_side(cache: dict, name: str) -> torch.Tensor:
    """Side tensor ``name``, made earlier on this stage or received from the previous one."""
    try:
        return cache[_SIDE][name]
    except KeyError:
        raise ValueError(f"side tensor {name!r} is not held on this stage (held: "
                         f"{sorted(cache.get(_SIDE, {}))})") from None


def held_sides(cache: dict) -> dict[str, torch.Tensor]:
    """The side tensors held now, by name."""
    return dict(cache.get(_SIDE, {}))
