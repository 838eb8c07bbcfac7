"""Side tensors: features that one unit produces and later units read (DeepStack features: made by
a ViT layer's merger, added to an LLM layer's output), held per micro-batch while a stage runs.

Inside a stage they live in the forward's ``cache`` (``put_side`` / ``take_side``).  Across stages they travel
with the hidden states through megatron-core's P2P (``megatron.vlm.stage``); which ones cross a boundary follows
from the planning side's ``SideTensor`` list (``omnibal_ext.model.spec.SideTensor``,
``omnibal_ext.model.families.Family.side_tensors``) and the layout: a side tensor is *live* at the boundary
before unit ``b`` when it is produced before ``b`` and read at or after ``b`` (``live_at``).

Packing.  megatron-core's P2P carries one tensor per boundary (``variable_seq_lengths``: its shape is exchanged
first), so the sender packs the hidden states ``[s, b, h]`` and the live side tensors ``[rows, width]`` into one
tensor ``[s + r, b, h]``: the hidden states, then the side tensors flattened one after the other in the order of
the family's list, zero-padded to whole ``b x h`` rows (``pack``; ``r = ceil(sum(rows x width) / (b x h))``).  The
receiver knows every side tensor's size on the host (``rows`` from the micro-batch: ``DataSide.side_rows``;
``width`` from the spec), so it gets ``s`` back from the received shape and cuts the hidden states and the side
tensors out as views of the received tensor (``unpack``): no copy, no host sync, no sizes sent.  Autograd carries
the gradients back through the same tensor (the receiver's input gradient holds the side tensors' gradients in
the same places), into the producer's merger and ViT.  The padding is under one row of ``b x h`` values.  Without
a live side tensor nothing changes (the hidden states travel alone).  megatron-core's ``deallocate_pipeline_outputs``
frees the packed output's storage after the send as before (a concatenation keeps no input alive); the packed tensor
is made viewless (``make_viewless_tensor``) like every stage output.

Tensor and sequence parallelism.  The P2P runs per TP rank, and every TP rank packs what it holds: under sequence
parallelism the hidden states are this rank's ``s / TP`` tokens and a side tensor is what its producer made, every
row on every TP rank (replicated: a producer inside the sequence-parallel ViT gathers its layer's output first,
``sequence_parallel.leave``, and its consumer adds the rows of this rank's tokens, scattering the full-length
addition with ``sequence_parallel.enter``, whose backward all-gathers the gradient, so every TP rank back-propagates
the same full gradient into its copy).  ``rows`` is then the same on every TP rank.

Context parallelism.  A side tensor made in the ViT holds the rows of this CP rank's vision items (the ViT is
data-parallel inside the CP group), ``DataSide.side_rows`` counts them; a consumer in the LLM gathers them over the
CP group and picks its tokens' rows, as the LLM embedding does with the projector's output
(``context_parallel.gather_rows``, ``image_feature_index``).
"""
from __future__ import annotations

from typing import Sequence

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


def live_at(sides: Sequence, boundary: int) -> tuple:
    """The side tensors (``SideTensor``) that cross the boundary before unit ``boundary``: produced before it,
    read at or after it; in the order of ``sides``."""
    return tuple(s for s in sides if s.producer < boundary <= s.last_consumer)


def pack(hidden: torch.Tensor, sides: Sequence[torch.Tensor]) -> torch.Tensor:
    """``hidden`` [s, b, h] and ``sides`` (each [rows, width], hidden's dtype) as one tensor [s + r, b, h] (module
    docstring); ``hidden`` itself when there are none."""
    if not sides:
        return hidden
    s, b, h = hidden.shape
    for t in sides:
        if t.dtype != hidden.dtype or t.device != hidden.device:
            raise ValueError(f"side tensor of {t.dtype} on {t.device} cannot travel with hidden states of "
                             f"{hidden.dtype} on {hidden.device}")
    n = sum(t.numel() for t in sides)
    extra = -(-n // (b * h))
    flat = [t.reshape(-1) for t in sides]
    if extra * b * h > n:
        flat.append(hidden.new_zeros(extra * b * h - n))
    return torch.cat([hidden, torch.cat(flat).view(extra, b, h)], dim=0)


def unpack(packed: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``pack``'s inverse: (hidden [s, b, h], the side tensors of ``shapes`` ((rows, width) each, host ints)),
    views of ``packed``."""
    if not shapes:
        return packed, []
    total, b, h = packed.shape
    sizes = [rows * width for rows, width in shapes]
    extra = -(-sum(sizes) // (b * h))
    s = total - extra
    if s <= 0:
        raise ValueError(f"received tensor {list(packed.shape)} cannot hold side tensors of shapes {list(shapes)} "
                         "beside hidden states")
    flat = packed[s:].reshape(-1)
    out, at = [], 0
    for (rows, width), size in zip(shapes, sizes):
        out.append(flat[at:at + size].view(rows, width))
        at += size
    return packed[:s], out
