"""Micro-batch collation of dataset samples into the schema the model consumes.

Batch schema (B samples; n_tiles = sum of their tiles)::

    tokens        int64 [b, s]   token ids, pad_id on padding
    labels        int64 [b, s]   shifted targets, -100 = no loss (padding included)
    position_ids  int64 [b, s]   0.. within each sample, restarting at each packed sample, 0 on padding
    segment_ids   int64 [b, s]   index of the sample within the micro-batch (0..B-1), -1 on padding
    pixel_values  float32 [n_tiles, 3, S, S]   all samples' tiles, concatenated in sample order
                                 (absent when the samples were read without images)
    image_flags   int64 [n_tiles]              1 real tile, 0 dummy tile of a text-only sample
    sample_tokens int64 [B]      real tokens per sample
    sample_tiles  int64 [B]      tiles per sample (dummy included)
    sample_answers list[int] (Python)  answer tokens (labels != -100) per sample: the loss reduction's n_s,
                                 on the host (megatron/training/loss_reduction.py)
    sample_ids    int64 [B]      dataset index of each sample (``sample_id`` of the sample dict; -1 when absent)
    tile_keys     int64 [n_tiles]  32-bit hash of (sample id, tile within its sample): the ViT drop path's
                                 per-tile key (megatron/vlm/layers/drop_path.py), host-built
    image_tile_index int64 [real tiles]  indices of the real tiles in pixel_values (host-built, so the
                                 model selects their features without a data-dependent shape)
    cu_seqlens    int32 [segments + 1]   cumulative segment lengths over the flattened micro-batch
                                 (row-major, b * s tokens): each sample is a segment, each run of
                                 padding is its own trailing segment; cu_seqlens[-1] == b * s
    max_seqlen    int (Python)   the longest segment

``cu_seqlens``/``max_seqlen`` are megatron-core's packed-sequence (THD) description of the micro-batch,
built here on the host once per micro-batch; padded (random) micro-batches are described the same way
(each row: its sample, then its padding), so the LLM has one attention path.  ``cu_seqlens`` stays on
the host (the trainer does not move it): the model copies it to the device only where a kernel needs it.

``collate_padded``: one sample per row (b = B), right padding to the longest sample or ``seq_length``, rounded
up to a multiple of ``pad_to_multiple`` (sequence parallelism: TP).
``collate_packed``: all samples in one row (b = 1), in order, padded to a multiple of ``pad_to_multiple``.
Tiles always follow the order in which their image-context tokens appear in ``tokens`` (row-major).
"""
from __future__ import annotations

import torch

from .template import IGNORE_INDEX
from megatron.vlm.layers.drop_path import tile_keys

BATCH_KEYS = ("tokens", "labels", "position_ids", "segment_ids", "pixel_values", "image_flags",
              "sample_tokens", "sample_tiles", "sample_answers", "sample_ids", "tile_keys", "image_tile_index",
              "cu_seqlens", "max_seqlen")
# stay on the host: read by Python, never waited for (``sample_tiles`` sizes the side tensors: megatron/vlm/stage/side.py)
HOST_KEYS = ("cu_seqlens", "max_seqlen", "sample_tiles")


def on_host(key: str) -> bool:
    """Whether a micro-batch field stays on the host: ``HOST_KEYS`` and every family's packed-sequence boundaries
    (fields named ``*seqlens``, e.g. a windowed ViT's ``vision_cu_window_seqlens``), which ``segment_params`` reads."""
    return key in HOST_KEYS or key.endswith("seqlens")


def packing(rows: list[list[int]], width: int) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32, max_seqlen) of a micro-batch of ``len(rows)`` rows of ``width`` tokens, row r
    holding the samples of lengths ``rows[r]`` in order, then padding (its own segment) up to ``width``."""
    lengths = []
    for row in rows:
        if sum(row) > width or any(n <= 0 for n in row):
            raise ValueError(f"packing: samples of lengths {row} in a row of {width} tokens")
        lengths += list(row) + ([width - sum(row)] if sum(row) < width else [])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return cu, max(lengths)


def _images(samples: list[dict]) -> dict:
    """Tile tensors of the micro-batch; ``pixel_values`` only when the samples carry pixels (a sample
    read without images has ``image_flags`` alone)."""
    flags = torch.cat([s["image_flags"] for s in samples]).to(torch.int64)
    pixels = {} if any("pixel_values" not in s for s in samples) else {
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]).to(torch.float32)}
    return {
        **pixels,
        "image_flags": flags,
        "image_tile_index": torch.nonzero(flags).flatten(),
        "sample_tokens": torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64),
        "sample_tiles": torch.tensor([len(s["image_flags"]) for s in samples], dtype=torch.int64),
        **sample_keys(samples),
    }


def sample_keys(samples: list[dict]) -> dict:
    """Host-side per-sample metadata: answer-token counts, dataset ids and the per-tile drop-path keys."""

    ids = [int(s.get("sample_id", -1)) for s in samples]
    return {
        "sample_answers": [int((torch.as_tensor(s["labels"]) != IGNORE_INDEX).sum()) for s in samples],
        "sample_ids": torch.tensor(ids, dtype=torch.int64),
        "tile_keys": tile_keys(ids, [len(s["image_flags"]) for s in samples]),
    }


def _check_samples(samples: list[dict]) -> None:
    if not samples:
        raise ValueError("collate: empty micro-batch")
    for k, s in enumerate(samples):
        if len(s["input_ids"]) != len(s["labels"]):
            raise ValueError(f"collate: sample {k} has {len(s['input_ids'])} input_ids but {len(s['labels'])} labels")
        if "pixel_values" in s and len(s["pixel_values"]) != len(s["image_flags"]):
            raise ValueError(f"collate: sample {k} has {len(s['pixel_values'])} tiles but "
                             f"{len(s['image_flags'])} image_flags")


def collate_padded(samples: list[dict], pad_id: int, seq_length: int | None = None, pad_to_multiple: int = 1) -> dict:
    """One sample per row, right-padded to ``seq_length`` (default: the longest sample), in tokens, rounded up
    to a multiple of ``pad_to_multiple``."""
    _check_samples(samples)
    if pad_to_multiple < 1:
        raise ValueError(f"collate_padded: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    longest = max(len(s["input_ids"]) for s in samples)
    width = longest if seq_length is None else seq_length
    width = -(-width // pad_to_multiple) * pad_to_multiple
    if longest > width:
        raise ValueError(f"collate_padded: a sample has {longest} tokens > seq_length {seq_length}")
    b = len(samples)
    tokens = torch.full((b, width), pad_id, dtype=torch.int64)
    labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros((b, width), dtype=torch.int64)
    segment_ids = torch.full((b, width), -1, dtype=torch.int64)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        tokens[row, :n] = torch.as_tensor(s["input_ids"])
        labels[row, :n] = torch.as_tensor(s["labels"])
        position_ids[row, :n] = torch.arange(n)
        segment_ids[row, :n] = row
    cu_seqlens, max_seqlen = packing([[len(s["input_ids"])] for s in samples], width)
    return {"tokens": tokens, "labels": labels, "position_ids": position_ids, "segment_ids": segment_ids,
            **_images(samples), "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}


def collate_packed(samples: list[dict], pad_id: int, pad_to_multiple: int = 1) -> dict:
    """All samples concatenated in one row (b = 1), padded up to a multiple of ``pad_to_multiple`` tokens."""
    _check_samples(samples)
    if pad_to_multiple < 1:
        raise ValueError(f"collate_packed: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    lengths = [len(s["input_ids"]) for s in samples]
    total = sum(lengths)
    width = -(-total // pad_to_multiple) * pad_to_multiple
    tokens = torch.full((1, width), pad_id, dtype=torch.int64)
    labels = torch.full((1, width), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros((1, width), dtype=torch.int64)
    segment_ids = torch.full((1, width), -1, dtype=torch.int64)
    start = 0
    for k, (s, n) in enumerate(zip(samples, lengths)):
        tokens[0, start:start + n] = torch.as_tensor(s["input_ids"])
        labels[0, start:start + n] = torch.as_tensor(s["labels"])
        position_ids[0, start:start + n] = torch.arange(n)
        segment_ids[0, start:start + n] = k
        start += n
    cu_seqlens, max_seqlen = packing([lengths], width)
    return {"tokens": tokens, "labels": labels, "position_ids": position_ids, "segment_ids": segment_ids,
            **_images(samples), "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}


def check_image_tokens(batch: dict, img_context_id: int, tokens_per_tile: int) -> None:
    """Raise ``ValueError`` unless the micro-batch's image-context tokens equal its real tiles x tokens_per_tile
    (the model writes one image feature into each such token; checked here, on the host, so that the
    model's forward never waits for the count)."""
    ctx = int((batch["tokens"] == img_context_id).sum())
    feats = len(batch["image_tile_index"]) * tokens_per_tile
    if ctx != feats:
        raise ValueError(f"micro-batch has {ctx} image-context tokens but its real tiles give {feats} image features")


def check_batch(batch: dict, img_context_id: int, tokens_per_tile: int) -> None:
    """Raise ``ValueError`` unless each sample's image-context tokens equal its real tiles x tokens_per_tile.

    Debug helper for the trainer; samples are found through ``segment_ids``.
    """
    flags_per_sample = torch.split(batch["image_flags"], batch["sample_tiles"].tolist())
    for k, flags in enumerate(flags_per_sample):
        in_sample = batch["segment_ids"] == k
        ctx = int((batch["tokens"][in_sample] == img_context_id).sum())
        if int(in_sample.sum()) != int(batch["sample_tokens"][k]):
            raise ValueError(f"batch: sample {k} has {int(in_sample.sum())} tokens, sample_tokens says "
                             f"{int(batch['sample_tokens'][k])}")
        if ctx != int(flags.sum()) * tokens_per_tile:
            raise ValueError(f"batch: sample {k} has {ctx} image-context tokens but {int(flags.sum())} real tiles "
                             f"x {tokens_per_tile} tokens per tile")
    if len(batch["pixel_values"]) != len(batch["image_flags"]):
        raise ValueError("batch: pixel_values and image_flags differ in length")
    check_image_tokens(batch, img_context_id, tokens_per_tile)
    cu = batch["cu_seqlens"]
    if cu.dtype != torch.int32 or int(cu[0]) != 0 or int(cu[-1]) != batch["tokens"].numel() \
            or int((cu[1:] - cu[:-1]).max()) != batch["max_seqlen"]:
        raise ValueError(f"batch: cu_seqlens {cu.tolist()} / max_seqlen {batch['max_seqlen']} do not describe "
                         f"{tuple(batch['tokens'].shape)} tokens")
