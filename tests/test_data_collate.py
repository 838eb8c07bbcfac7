"""Micro-batch collation: padded and packed carry the same samples; image tokens match tiles, in order."""
import numpy as np
import pytest
import torch

from megatron.vlm.data import (BATCH_KEYS, ByteTokenizer, RecordDataset, TileImages, build_digits_dataset, check_batch,
                               collate_packed, collate_padded)

TOK = ByteTokenizer()
TPT = 4


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    meta = build_digits_dataset(str(tmp_path_factory.mktemp("digits") / "d"), num_samples=60, tile_size=32)
    ds = RecordDataset(meta, TOK, TileImages(32, TPT, max_num_tiles=6), max_seq_length=512)
    real = ds.sample_real_items()
    text_only = np.flatnonzero(real == 0)[:2].tolist()
    picked = [ds[i] for i in sorted(set(range(10)) | set(text_only))]
    assert any(s["image_flags"].sum() == 0 for s in picked) and any(len(s["image_flags"]) > 1 for s in picked)
    # make every tile identifiable: tile t of the micro-batch gets the constant value t
    t = 0
    for s in picked:
        s["pixel_values"] = torch.arange(t, t + len(s["pixel_values"]), dtype=torch.float32)[:, None, None, None] \
            .expand(-1, 3, 32, 32).clone()
        t += len(s["pixel_values"])
    return picked


def rows_of(batch):
    """Per sample: (tokens, labels, position_ids) cut out of the batch through segment_ids."""
    out = []
    for k in range(len(batch["sample_tokens"])):
        mask = batch["segment_ids"] == k
        out.append((batch["tokens"][mask], batch["labels"][mask], batch["position_ids"][mask]))
    return out


def tiles_by_token_order(batch):
    """Walk the image blocks in token order (row-major) and hand them consecutive real tiles."""
    real = batch["pixel_values"][batch["image_flags"] == 1][:, 0, 0, 0].long().tolist()
    owners = []
    for row_tokens, row_segments in zip(batch["tokens"], batch["segment_ids"]):
        starts = torch.nonzero(row_tokens == TOK.img_start_id).flatten().tolist()
        ends = torch.nonzero(row_tokens == TOK.img_end_id).flatten().tolist()
        for s, e in zip(starts, ends):
            n = int((row_tokens[s:e] == TOK.img_context_id).sum())
            assert n % TPT == 0
            owners += [int(row_segments[s])] * (n // TPT)
    assert len(owners) == len(real)
    return list(zip(owners, real))


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_schema_and_invariants(samples, mode):
    batch = collate_padded(samples, TOK.pad_id) if mode == "padded" else collate_packed(samples, TOK.pad_id, 64)
    assert set(batch) == set(BATCH_KEYS)
    b = len(samples) if mode == "padded" else 1
    assert batch["tokens"].shape[0] == b and batch["tokens"].dtype == torch.int64
    for key in ("labels", "position_ids", "segment_ids"):
        assert batch[key].shape == batch["tokens"].shape and batch[key].dtype == torch.int64
    assert batch["pixel_values"].dtype == torch.float32
    n_tiles = sum(len(s["image_flags"]) for s in samples)
    assert batch["pixel_values"].shape == (n_tiles, 3, 32, 32) and batch["image_flags"].shape == (n_tiles,)
    assert batch["sample_tokens"].tolist() == [len(s["input_ids"]) for s in samples]
    assert batch["sample_tiles"].tolist() == [len(s["image_flags"]) for s in samples]
    # image-context tokens = real tiles x tokens per tile, globally and per sample
    assert int((batch["tokens"] == TOK.img_context_id).sum()) == int(batch["image_flags"].sum()) * TPT
    check_batch(batch, TOK.img_context_id, TPT)
    # padding: pad id, no loss, position 0, segment -1
    pad = batch["segment_ids"] == -1
    assert (batch["tokens"][pad] == TOK.pad_id).all() and (batch["labels"][pad] == -100).all()
    assert (batch["position_ids"][pad] == 0).all()
    assert int((~pad).sum()) == sum(len(s["input_ids"]) for s in samples)
    # each sample's tiles are the ones its tokens come in, in that order
    first_tile = np.cumsum([0] + [len(s["image_flags"]) for s in samples])
    expected = [(k, int(first_tile[k]) + j) for k, s in enumerate(samples) for j in range(int(s["image_flags"].sum()))]
    assert tiles_by_token_order(batch) == expected


def test_packed_and_padded_carry_the_same_samples(samples):
    padded = collate_padded(samples, TOK.pad_id, seq_length=600)
    packed = collate_packed(samples, TOK.pad_id, pad_to_multiple=128)
    assert padded["tokens"].shape == (len(samples), 600)
    assert packed["tokens"].shape[1] % 128 == 0
    for s, a, p in zip(samples, rows_of(padded), rows_of(packed)):
        for x, y, ref in zip(a, p, (s["input_ids"], s["labels"], torch.arange(len(s["input_ids"])))):
            assert torch.equal(x, ref) and torch.equal(y, ref)
    assert torch.equal(padded["pixel_values"], packed["pixel_values"])
    assert torch.equal(padded["image_flags"], packed["image_flags"])
    # segments in the packed row are contiguous and in sample order
    seg = packed["segment_ids"][0]
    real = seg[seg >= 0]
    assert torch.equal(real, torch.repeat_interleave(torch.arange(len(samples)), packed["sample_tokens"]))


def test_errors(samples):
    with pytest.raises(ValueError, match="seq_length 10"):
        collate_padded(samples, TOK.pad_id, seq_length=10)
    with pytest.raises(ValueError, match="empty"):
        collate_packed([], TOK.pad_id)
    batch = collate_packed(samples, TOK.pad_id)
    batch["image_flags"] = torch.ones_like(batch["image_flags"])  # claim the dummy tiles are real
    with pytest.raises(ValueError, match="image-context tokens"):
        check_batch(batch, TOK.img_context_id, TPT)


def test_cu_seqlens_describe_samples_and_padding(samples):
    """THD description of a micro-batch: each sample a segment, each run of padding its own, over the
    flattened rows; built on the host (int32 tensor, Python int max_seqlen)."""
    lengths = [len(s["input_ids"]) for s in samples]
    padded = collate_padded(samples[:3], TOK.pad_id, seq_length=600)
    want = []
    for n in lengths[:3]:
        want += [n, 600 - n]
    assert padded["cu_seqlens"].dtype == torch.int32 and padded["cu_seqlens"].device.type == "cpu"
    assert padded["cu_seqlens"].tolist() == np.cumsum([0] + want).tolist()
    assert padded["max_seqlen"] == max(want) and isinstance(padded["max_seqlen"], int)
    packed = collate_packed(samples, TOK.pad_id, pad_to_multiple=128)
    width = packed["tokens"].shape[1]
    want = lengths + ([width - sum(lengths)] if width > sum(lengths) else [])
    assert packed["cu_seqlens"].tolist() == np.cumsum([0] + want).tolist()
    assert packed["max_seqlen"] == max(want)
    exact = collate_packed(samples[:2], TOK.pad_id)  # no padding: no padding segment
    assert exact["cu_seqlens"].tolist() == [0, lengths[0], lengths[0] + lengths[1]]
    # the real tiles' indices, for the model to select their features without reading a count
    assert torch.equal(packed["image_tile_index"], torch.nonzero(packed["image_flags"]).flatten())
