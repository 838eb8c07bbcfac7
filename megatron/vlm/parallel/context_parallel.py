"""Context parallelism (--context-parallel-size) for the LLM, and the ViT's tiles divided over the same ranks.

The CP ranks of a data-parallel rank read the same micro-batch; each keeps its part (the family's
``Batcher.split_cp``, applied by the collate on the host; the default (tiles) is ``split_batch``: the tokens'
``split_tokens``, shared by every family, and the tiles' ``split_tiles``):

* LLM tokens: every segment of the micro-batch's THD description (each sample, each run of padding) is padded at
  its end to a multiple of 2 x CP tokens (2 x CP x TP with sequence parallelism, so that TP divides every rank's
  part of every segment and megatron-core's sequence-parallel scatter splits the rank's tokens evenly; pads:
  ``pad_id``, label -100, segment -1; after every real token of the sample, so causal attention never lets a real
  token see them) and cut into 2 x CP equal chunks; CP rank r keeps
  chunks r and 2 CP - 1 - r of every segment, in that order.  Under causal attention chunk i attends to i + 1
  chunks, so every rank attends (r + 1) + (2 CP - r) = 2 CP + 1 chunks per segment: balanced per sample.
  ``cu_seqlens``/``max_seqlen`` describe the padded, *unsplit* micro-batch (megatron-core's and TransformerEngine's
  convention: a rank's part of a segment is its length / CP), so megatron-core's THD RoPE gives each token the
  position it has in the unsplit sample (``position_ids`` hold it too).
* ViT tiles: the micro-batch's tiles (dummy tiles included) are cut into CP contiguous runs, as even as whole
  tiles allow (at most ceil(tiles / CP) each); rank r's ViT runs on its run only (the ViT is data-parallel inside
  the CP group).  The LLM embedding all-gathers the projector's output over the CP group (``gather_rows`` of
  every rank's tiles x tokens per tile; backward: reduce-scatter) and picks, for each of its image-context tokens,
  the feature of that token in the unsplit micro-batch (``image_feature_index``, host-built).
* Images of varying size (a family's own ``Batcher.split_cp``): window and full attention need a whole image, so
  images (and videos) go whole to the ranks, in contiguous runs of the micro-batch's order balanced by predicted ViT
  time (the least possible largest run: ``cp_split.image_runs`` of ``sample_time.grid_vit_time_units``: patches
  plus full attention quadratic per segment, a video's segments its temporal patches, windows per temporal slice);
  a video over one rank's share of --omnibal-isf-qv is refused before training (``training/isf.py``); a rank
  gets its images' pixel rows and their ViT fields, one all-zero 2 x 2-patch image whose output
  nobody reads when it has none.  ``vision_rank_tokens`` (every rank's merged tokens, host ints) sizes the LLM
  embedding's ``gather_rows``, then ``image_feature_index`` picks as above.  Multimodal RoPE: the
  ``mrope_position_ids`` stay in the padded, unsplit layout (each segment padded as above), one frequency row per
  token of ``cu_seqlens``, which megatron-core's THD RoPE (given the CP group in the packed parameters) slices to
  this rank's chunks by absolute offset.
* ViT layers are built with a CP group of their rank alone (``vision_process_groups``): their tokens are not CP
  chunks, and megatron-core's RoPE would slice them as such.

The core attention (``megatron.vlm.layers.attention.SegmentAttention``) all-gathers keys and values over the CP group
(differentiable: the backward reduce-scatters, so each rank gets the gradients every rank's queries put on its
keys and values), puts each segment's back in order (``CPSegments.kv_index``) and attends each local query chunk
to the keys up to it (bottom-right causal).  Gradients are reduced over DP x CP by megatron-core's DDP
(``dp_cp_group``), and the loss of a micro-batch is the sum over the CP ranks' tokens (per-token loss: the token
count is all-reduced over DP x CP by ``finalize_model_grads``).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

# the split arithmetic, shared with the planner (tensor-free); chunk_pairs and rank_work are re-exported
from omnibal_ext.model.cp_split import chunk_pairs  # noqa: F401
from omnibal_ext.model.cp_split import padded_chunk, rank_chunks, rank_work, tile_ranges

IGNORE_INDEX = -100


def split_batch(batch: dict, cp: int, rank: int, pad_id: int, img_context_id: int | None, sp_tp: int = 1) -> dict:
    """CP rank ``rank``'s part of a collated micro-batch of tiles (see the module docstring; the default
    ``Batcher.split_cp``): ``split_tiles`` then ``split_tokens``."""
    return split_tokens(split_tiles(batch, cp, rank), cp, rank, pad_id, img_context_id, sp_tp)


def split_tiles(batch: dict, cp: int, rank: int) -> dict:
    """The vision part of the tiled split: pixel_values (and the drop path's ``tile_keys``) of this rank's run of
    tiles (``tile_ranges``; one tile whose output nobody reads when the rank has none); ``num_tiles`` (a Python int,
    the micro-batch's tiles) added; the per-sample and per-tile metadata stay whole."""
    out = dict(batch)
    n_tiles = int(batch["sample_tiles"].sum())
    out["num_tiles"] = n_tiles
    if "pixel_values" in batch:
        tiles = tile_ranges(n_tiles, cp)[rank]
        if len(tiles) == 0:  # fewer tiles than CP ranks: run one tile whose output nobody reads (keeps shapes)
            tiles = range(0, 1)
        out["pixel_values"] = batch["pixel_values"][tiles.start:tiles.stop]
        if "tile_keys" in batch:  # the drop path's keys of this rank's tiles
            out["tile_keys"] = batch["tile_keys"][tiles.start:tiles.stop]
    return out


def padded_layout(bounds: list[int], cp: int, sp_tp: int = 1, rank: int | None = None) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(source, position) int64 [tokens]: for every token of the padded layout of the micro-batch whose segments
    have ``cu_seqlens`` ``bounds`` (each segment padded at its end to a multiple of 2 x cp x sp_tp), its index in
    the unsplit micro-batch (-1: a pad) and its position in its segment; ``rank`` given: only that CP rank's
    chunks (r and 2 cp - 1 - r of every segment, in that order), None: the whole padded, unsplit layout."""
    src, pos = [], []
    for a, e in zip(bounds[:-1], bounds[1:]):
        padded, c = padded_chunk(e - a, cp, sp_tp)
        spans = [range(padded)] if rank is None else [range(i * c, (i + 1) * c) for i in rank_chunks(cp, rank)]
        for span in spans:
            for p in span:
                src.append(a + p if a + p < e else -1)
                pos.append(p)
    return torch.tensor(src, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)


def split_tokens(batch: dict, cp: int, rank: int, pad_id: int, img_context_id: int | None, sp_tp: int = 1) -> dict:
    """The LLM part of CP rank ``rank``'s split (module docstring; sp_tp: the TP size under sequence parallelism,
    else 1): tokens, labels, position_ids, segment_ids become [1, t / cp] (t: the padded total),
    ``cu_seqlens``/``max_seqlen`` the padded unsplit ones; with tokens and ``img_context_id``,
    ``image_feature_index`` (each local image-context token's ordinal among the unsplit micro-batch's) is added.
    Every other field is left as it is."""
    out = dict(batch)
    if "cu_seqlens" not in batch:
        return out
    bounds = batch["cu_seqlens"].tolist()
    src_t, pos_t = padded_layout(bounds, cp, sp_tp, rank)
    real = src_t >= 0
    take = src_t.clamp(min=0)

    def pick(key: str, fill) -> torch.Tensor:
        flat = batch[key].reshape(-1)
        return torch.where(real, flat[take], torch.full_like(take, fill)).reshape(1, -1)

    for key, fill in (("tokens", pad_id), ("labels", IGNORE_INDEX), ("segment_ids", -1)):
        if key in batch:
            out[key] = pick(key, fill)
    if "position_ids" in batch:  # the position in the unsplit segment (a sample's own positions; pads go on)
        out["position_ids"] = pos_t.reshape(1, -1)
    lengths = [padded_chunk(e - a, cp, sp_tp)[0] for a, e in zip(bounds[:-1], bounds[1:])]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    out["cu_seqlens"], out["max_seqlen"] = cu, max(lengths)
    if "tokens" in batch and img_context_id is not None:
        is_img = batch["tokens"].reshape(-1) == img_context_id
        ordinal = torch.cumsum(is_img.to(torch.int64), 0) - 1
        local_img = real & is_img[take]
        out["image_feature_index"] = ordinal[take][local_img]
    return out


@dataclasses.dataclass(frozen=True)
class CPSegments:
    """A micro-batch's segments as one CP rank's core attention sees them (host-built once per micro-batch).

    chunks: per segment (local start, chunk length, global start in the gathered, reordered keys);
    kv_index: [padded total] indices into the CP all-gather of the ranks' keys [cp x t_local] that put every
    segment's keys back in order.
    """

    group: object
    size: int
    rank: int
    chunks: tuple[tuple[int, int, int], ...]
    kv_index: torch.Tensor


def cp_segments(global_bounds: list[int], group) -> CPSegments:
    """``CPSegments`` of the padded, unsplit ``cu_seqlens`` bounds for this rank of ``group``."""
    cp, rank = group.size(), group.rank()
    t_local = global_bounds[-1] // cp
    chunks, index = [], []
    local = 0
    for a, e in zip(global_bounds[:-1], global_bounds[1:]):
        c = (e - a) // (2 * cp)
        if c * 2 * cp != e - a:
            raise ValueError(f"context parallel: segment of {e - a} tokens is not a multiple of 2 x CP = {2 * cp}")
        chunks.append((local, c, a))
        for i in range(2 * cp):  # chunk i of the segment: on rank j = i or 2cp-1-i, first or second half there
            j, half = (i, 0) if i < cp else (2 * cp - 1 - i, 1)
            start = j * t_local + local + half * c
            index.extend(range(start, start + c))
        local += 2 * c
    return CPSegments(group, cp, rank, tuple(chunks), torch.tensor(index, dtype=torch.int64))


def all_gather_cp(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on every rank of ``group`` -> [size x n, ...] in rank order; backward: reduce-scatter (sum)."""

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)


def gather_rows(x: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """Rows of every rank of ``group`` in rank order: this rank's first ``counts[rank]`` rows of ``x [n, ...]``
    (rows after them, a dummy item's output, are dropped) -> [sum(counts), ...] (padded to the largest count for
    the all-gather, padding dropped; backward: reduce-scatter). ``counts``: per rank, equal on every rank (host
    ints). A tiled projector's output: tiles x tokens per tile of each rank's run (``tile_ranges``)."""
    rank, longest = group.rank(), max(counts)
    mine = x[:counts[rank]]
    if longest == 0:  # no rank has rows for anyone (every rank knows it)
        return mine
    if mine.shape[0] < longest:
        mine = torch.cat([mine, mine.new_zeros((longest - mine.shape[0], *mine.shape[1:]))])
    gathered = all_gather_cp(mine.contiguous(), group)
    keep = torch.cat([torch.arange(j * longest, j * longest + n) for j, n in enumerate(counts)])
    return gathered.index_select(0, keep.to(gathered.device))


def context_parallel_group():
    """megatron-core's context-parallel group when it has more than one rank, else None."""

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def vision_process_groups():
    """megatron-core's process groups for ViT layers: under CP the ViT is data-parallel inside the CP group (each
    rank runs its own items whole), so its layers get the CP group ``own_rank_group`` (megatron-core's THD RoPE
    would otherwise cut per-token frequencies into CP chunks); None without CP (megatron-core's default groups)."""
    own = own_rank_group()
    if own is None:
        return None

    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.cp = own
    return groups


def own_rank_group():
    """Under CP, a process group of this rank alone, for megatron-core parts that would otherwise slice what they
    compute by the CP group (made once per CP group: per run, see ``forget_own_groups``); None without CP."""
    group = context_parallel_group()
    return None if group is None else _own_group(group)


@functools.cache
def _own_group(cp_group):
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def forget_own_groups() -> None:
    """Drop the one-rank groups made for the run's CP groups (``initialize.reset_global_state``: the run is over, its
    groups are destroyed)."""
    _own_group.cache_clear()
