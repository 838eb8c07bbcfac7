"""The typed micro-batch: what one pipeline stage of one data-parallel rank reads of one micro-batch.

A ``MicroBatch`` holds parts, each a frozen dataclass of tensors and host values; a part (or a field of it) that
the stage does not read is None (``StageInputs`` says what a stage reads; ``MicroBatch.of`` builds the stage's
batch from the collated fields, each part keeping the fields its readers need):

* ``text`` (``TextPart``): ``tokens`` where the LLM embedding is, ``labels`` where the head is;
* ``packing`` (``PackingPart``): the THD description (``cu_seqlens``, ``max_seqlen``; host) and the per-token
  ``segment_ids``/``position_ids``, where LLM layers or the head are;
* ``vision`` (a ``VisionPart``): the family's image fields (its subclass, defined with the family: ``TileVision``
  here for dynamic tiles); each field declares the stage parts that read it (``reads``), e.g. pixels where the
  ViT embedding is; a field without that declaration (the drop path's ``tile_keys``) goes to every stage;
* ``cp`` (``CPPart``): this context-parallel rank's fields made by the family's ``Batcher.split_cp``; None
  without context parallelism;
* ``samples`` (``SampleInfo``): the per-sample host metadata every stage gets (sizes, answer counts, ids);
* ``iteration``: the training iteration the micro-batch belongs to (the drop path's key), set when
  ``MicroBatches`` serves it (``dataclasses.replace``).

Field names are the collate's (``megatron/vlm/data/collate.py``'s schema); the fields that stay on the host are
those ``collate.on_host`` names (packed-sequence boundaries, ``sample_tiles``). ``to(device)`` moves the others,
``broadcast_micro_batch`` sends the structure as one object and then every tensor, and the batch pickles
(DataLoader workers) as any dataclass of tensors.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron.vlm.data.collate import on_host

PARTS = ("pixels", "tokens", "labels", "packing")  # StageInputs' fields


def reads(*parts: str, default=None):
    """A ``VisionPart``/``CPPart`` field read only by stages reading one of ``parts`` (``StageInputs`` fields)."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"reads: unknown micro-batch parts {sorted(unknown)}")
    return field(default=default, metadata={"reads": parts})


class Part:
    """Shared behaviour of the parts: built from collated fields, reduced to a stage's reads."""

    @classmethod
    def from_fields(cls, fields: dict):
        """The part of the collated ``fields`` (keys: the part's field names; absent ones are None)."""
        return cls(**{f.name: fields.get(f.name) for f in dataclasses.fields(cls)})

    def for_stage(self, inputs):
        """This part with None in the fields a stage reading ``inputs`` (``StageInputs``) does not read."""
        drop = {f.name: None for f in dataclasses.fields(self)
                if "reads" in f.metadata and not any(getattr(inputs, p) for p in f.metadata["reads"])}
        return dataclasses.replace(self, **drop) if drop else self


@dataclass(frozen=True)
class TextPart(Part):
    """tokens int64 [b, s] (pad_id on padding) where the LLM embedding is; labels int64 [b, s] (shifted targets,
    -100 = no loss) where the head is."""

    tokens: torch.Tensor | None = reads("tokens")
    labels: torch.Tensor | None = reads("labels")


@dataclass(frozen=True)
class PackingPart(Part):
    """THD description of the micro-batch (``collate.packing``): cu_seqlens int32 [segments + 1] and max_seqlen
    (int), on the host; segment_ids int64 [b, s] (sample in the micro-batch, -1 padding); position_ids int64 [b, s].
    decode: generation only (``megatron.vlm.inference``), the decode step whose KV and recurrent caches the LLM layers
    read and extend (each segment one sequence's new tokens; the RoPE positions are then ``position_ids``); None in
    training and logits checks."""

    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    segment_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    decode: object | None = None


@dataclass(frozen=True)
class VisionPart(Part):
    """A family's image fields (subclass it with the family). tile_keys int64 [ViT items]: the drop path's key of
    each ViT item (tile or patch row; ``megatron/vlm/layers/drop_path.py``), host-built, given to every stage."""

    tile_keys: torch.Tensor | None = None


@dataclass(frozen=True)
class TileVision(VisionPart):
    """Dynamic tiles (``collate.py``'s fields): pixel_values float32 [tiles, 3, S, S] and image_flags int64 [tiles]
    (1 real, 0 dummy) where the ViT embedding is; image_tile_index int64 [real tiles] where the LLM embedding is."""

    pixel_values: torch.Tensor | None = reads("pixels")
    image_flags: torch.Tensor | None = reads("pixels")
    image_tile_index: torch.Tensor | None = reads("tokens")


@dataclass(frozen=True)
class CPPart(Part):
    """This context-parallel rank's fields (``megatron/vlm/parallel/context_parallel.py``): num_tiles (int: the micro-batch's
    tiles, tiled split); image_feature_index int64 [local image-context tokens] (each one's ordinal in the unsplit
    micro-batch) and vision_rank_tokens (list[int]: every rank's merged image tokens, per-image split) where the
    LLM embedding is."""

    num_tiles: int | None = None
    image_feature_index: torch.Tensor | None = reads("tokens")
    vision_rank_tokens: list[int] | None = reads("tokens")

    @classmethod
    def split_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class SampleInfo(Part):
    """Per-sample host metadata (every stage): sample_tokens int64 [B] (real tokens), sample_tiles int64 [B] (ViT
    items, dummy tiles included; host), sample_answers list[int] (answer tokens: the loss reduction's n_s),
    sample_ids int64 [B] (dataset index, -1 unknown)."""

    sample_tokens: torch.Tensor | None = None
    sample_tiles: torch.Tensor | None = None
    sample_answers: list[int] | None = None
    sample_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class MicroBatch:
    """See the module docstring."""

    text: TextPart | None = None
    packing: PackingPart | None = None
    vision: VisionPart | None = None
    cp: CPPart | None = None
    samples: SampleInfo = SampleInfo()
    iteration: int = 0

    @classmethod
    def of(cls, fields: dict, vision: type[VisionPart] | None = TileVision, inputs=None) -> "MicroBatch":
        """The micro-batch a stage reading ``inputs`` (``StageInputs``; None: everything) gets of the collated
        ``fields``: parts it does not read are None, and so are fields of its parts it does not read. ``vision``:
        the family's ``VisionPart`` (None: no vision part). A CP part exists where the split made its fields."""
        inputs = inputs or StageInputs.everything()
        text = TextPart.from_fields(fields).for_stage(inputs) if inputs.tokens or inputs.labels else None
        packing = PackingPart.from_fields(fields) if inputs.packing else None
        cp = CPPart.from_fields(fields).for_stage(inputs) if any(k in fields for k in CPPart.split_fields()) else None
        return cls(text=text, packing=packing, vision=None if vision is None else vision.from_fields(fields).for_stage(
            inputs), cp=cp, samples=SampleInfo.from_fields(fields), iteration=int(fields.get("iteration", 0)))

    def fields(self) -> dict:
        """The flat fields (the collate's names) this micro-batch holds, None ones left out (the inverse of
        ``of``, for checks and tools that work on the collated fields)."""
        out = {}
        _map(self, lambda k, v: out.setdefault(k, v) if v is not None else v)
        return out

    def map_tensors(self, fn: Callable[[str, torch.Tensor], object]) -> "MicroBatch":
        """This micro-batch with every tensor field ``t`` of name ``k`` replaced by ``fn(k, t)``."""
        return _map(self, lambda k, v: fn(k, v) if isinstance(v, torch.Tensor) else v)

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        """The tensors on ``device``, except the host-held fields (``collate.on_host``)."""
        return self.map_tensors(lambda k, t: t if on_host(k) else t.to(device, non_blocking=non_blocking))

    def with_vision(self, **changes) -> "MicroBatch":
        """This micro-batch with ``changes`` to its vision part's fields."""
        return dataclasses.replace(self, vision=dataclasses.replace(self.vision, **changes))


def _map(obj, fn):
    """``obj`` (a part or a micro-batch) with each leaf field ``v`` of name ``k`` replaced by ``fn(k, v)``."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        changes[f.name] = _map(value, fn) if isinstance(value, Part) else fn(f.name, value)
    return dataclasses.replace(obj, **changes)


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in the broadcast structure."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_micro_batch(batch: MicroBatch | None, src: int, group) -> MicroBatch:
    """``batch`` of global rank ``src`` on every rank of ``group``: one object broadcast of its structure (parts,
    shapes, dtypes and its Python values), then one broadcast per tensor in field order. Tensors travel on the host
    with a gloo group; with NCCL they travel on the current CUDA device (and arrive there), except the host-held
    fields (``collate.on_host``: small, sent by value)."""

    cuda = dist.get_backend(group) == "nccl"
    me = dist.get_rank()
    header = [batch.map_tensors(lambda k, t: _Slot(tuple(t.shape), t.dtype)) if me == src else None]
    dist.broadcast_object_list(header, src=src, group=group)
    sent = []
    if me == src:
        batch.map_tensors(lambda k, t: sent.append(t))
    sent = iter(sent)

    def receive(k, v):
        if not isinstance(v, _Slot):
            return v
        device = "cuda" if cuda and not on_host(k) else "cpu"
        if me == src:
            t = next(sent).contiguous()
            t = t.cuda() if device == "cuda" else t
        else:
            t = torch.empty(v.shape, dtype=v.dtype, device=device)
        if cuda and on_host(k):  # packed-sequence boundaries stay on the host: small, sent by value
            holder = [t if me == src else None]
            dist.broadcast_object_list(holder, src=src, group=group)
            return holder[0]
        dist.broadcast(t, src=src, group=group)
        return t

    return _map(header[0], receive)


@dataclasses.dataclass(frozen=True)
class StageInputs:
    """Which parts of a micro-batch a pipeline stage reads (see module docstring; ``megatron.vlm.stage.micro_batch``:
    the ``MicroBatch`` parts, and the vision and CP fields, each reading declares)."""

    pixels: bool = True  # the ViT embedding: pixels and the ViT's fields
    tokens: bool = True  # the LLM embedding: tokens (text part), the tiles' or image tokens' indices
    labels: bool = True  # the head (and its loss): labels (text part)
    packing: bool = True  # LLM layers, head: the packing part (cu_seqlens, max_seqlen, segment_ids, position_ids)

    @classmethod
    def everything(cls) -> "StageInputs":
        return cls()

    @classmethod
    def reading(cls, parts) -> "StageInputs":
        """Only the parts named in ``parts`` (field names: "pixels", "tokens", "labels", "packing"); a stage's
        are the union of its units' kinds' ``reads`` (``megatron.vlm.stage.components.units_inputs``)."""
        parts = set(parts)
        unknown = parts - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"StageInputs: unknown micro-batch parts {sorted(unknown)}")
        return cls(**{f.name: f.name in parts for f in dataclasses.fields(cls)})
