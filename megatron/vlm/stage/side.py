"""Side tensors: features that one unit produces and later units read (DeepStack features: made by
a ViT layer's merger, added to an LLM layer's output), held per micro-batch while a stage runs.

Inside a stage they live in the forward's typed per-micro-batch cache (``StageCache.put_side`` / ``take_side``).  Across stages they travel
with the hidden states through megatron-core's P2P (``megatron.vlm.stage.build``); which ones cross a boundary follows
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

import dataclasses
from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")


@dataclasses.dataclass
class StageCache:
    """What one stage's units share while it runs one micro-batch, typed (a new one per forward):

    * contexts built once per micro-batch by the first unit that needs them and read by the next (the LLM blocks'
      ``TextContext``, a ViT's rotary angles and packed parameters), each held under its own type (``once``), so a
      unit gets back exactly the type it asked for and two kinds never collide on a key;
    * the side tensors on hand (``put_side`` / ``take_side``), made on this stage or received with the input.
    """

    _contexts: dict[type, object] = dataclasses.field(default_factory=dict)
    _sides: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def once(self, kind: type[T], make: Callable[[], T]) -> T:
        """The ``kind`` context of this micro-batch: made by ``make`` the first time (an instance of ``kind``)."""
        held = self._contexts.get(kind)
        if held is None:
            held = make()
            if not isinstance(held, kind):
                raise TypeError(f"StageCache.once: made a {type(held).__name__}, not a {kind.__name__}")
            self._contexts[kind] = held
        return held

    def put_side(self, name: str, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` as side tensor ``name`` for the rest of this micro-batch's forward (and later stages)."""
        if name in self._sides:
            raise ValueError(f"side tensor {name!r} produced twice in one micro-batch")
        self._sides[name] = tensor

    def take_side(self, name: str) -> torch.Tensor:
        """Side tensor ``name``, made earlier on this stage or received from the previous one."""
        try:
            return self._sides[name]
        except KeyError:
            raise ValueError(f"side tensor {name!r} is not held on this stage (held: {sorted(self._sides)})") from None

    def held_sides(self) -> dict[str, torch.Tensor]:
        """The side tensors held now, by name."""
        return dict(self._sides)


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
