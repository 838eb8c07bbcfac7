"""Context parallelism's split (megatron/vlm/parallel/context_parallel.py), on the host: chunks, positions, image
features, the attention's key order, and the balance of the published OmniBal stats packed by ISF."""
import math

import pytest
import torch

from conftest import STATS_FILES
from megatron.vlm.parallel.context_parallel import cp_segments, rank_work, split_batch, tile_ranges
from megatron.vlm.data.collate import collate_packed, collate_padded

IMG, PAD = 9, 0


def samples():
    """Three samples: 2 tiles (1 image-context token each) + text, text-only (a dummy tile), 1 tile."""
    first_tile = [0]

    def s(ids, flags):  # pixel values: the tile's index in the micro-batch
        ids = torch.tensor(ids)
        tiles = torch.arange(first_tile[0], first_tile[0] + len(flags), dtype=torch.float32)
        first_tile[0] += len(flags)
        return {"input_ids": ids, "labels": ids + 100, "image_flags": torch.tensor(flags),
                "pixel_values": tiles.view(-1, 1, 1, 1).expand(-1, 3, 2, 2)}
    return [s([1, IMG, IMG, 2, 3, 4, 5], [1, 1]), s([6, 7, 8], [0]), s([IMG, 10, 11, 12, 13], [1])]


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("cp,sp_tp", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2)])
def test_split_reassembles_the_padded_batch(packed, cp, sp_tp):
    """sp_tp: --sequence-parallel's TP (segments padded to 2 x CP x TP: every rank's part of each splits over TP)."""
    whole = collate_packed(samples(), PAD) if packed else collate_padded(samples(), PAD)
    parts = [split_batch(whole, cp, r, PAD, IMG, sp_tp=sp_tp) for r in range(cp)]
    cu = parts[0]["cu_seqlens"].tolist()
    assert all(p["cu_seqlens"].tolist() == cu for p in parts)
    assert all((e - a) % (2 * cp * sp_tp) == 0 and e - a - (2 * cp * sp_tp) < e0 - a0
               for a, e, a0, e0 in zip(cu[:-1], cu[1:], whole["cu_seqlens"][:-1].tolist(),
                                       whole["cu_seqlens"][1:].tolist()))
    t_local = cu[-1] // cp
    assert t_local % sp_tp == 0
    assert all(p["tokens"].shape == (1, t_local) for p in parts)
    # the attention's gather order puts every segment back together: the unsplit padded micro-batch
    gathered = torch.cat([p["tokens"][0] for p in parts])
    order = torch.cat([cp_segments(cu, FakeGroup(cp, r)).kv_index for r in range(1)])
    rebuilt = gathered[order]
    flat_tokens, flat_labels = whole["tokens"].reshape(-1), whole["labels"].reshape(-1)
    old = whole["cu_seqlens"].tolist()
    for (a, e), (na, ne) in zip(zip(old[:-1], old[1:]), zip(cu[:-1], cu[1:])):
        assert rebuilt[na:na + e - a].tolist() == flat_tokens[a:e].tolist()
        assert (rebuilt[na + e - a:ne] == PAD).all()
        # positions are the unsplit ones, labels follow their tokens, pads take no loss
    for r, p in enumerate(parts):
        seg = cp_segments(cu, FakeGroup(cp, r))
        for local, c, start in seg.chunks:
            for half, i in enumerate((r, 2 * cp - 1 - r)):
                pos = p["position_ids"][0, local + half * c: local + (half + 1) * c]
                assert pos.tolist() == list(range(i * c, (i + 1) * c))
    labels = torch.cat([p["labels"][0] for p in parts])[order]
    assert int((labels != -100).sum()) == int((flat_labels != -100).sum())
    # image features: each rank's image-context tokens name their ordinal in the unsplit micro-batch
    ords = sorted(sum((p["image_feature_index"].tolist() for p in parts), []))
    assert ords == list(range(int((flat_tokens == IMG).sum())))
    for p in parts:
        assert len(p["image_feature_index"]) == int((p["tokens"] == IMG).sum())
    # tiles: contiguous, as even as whole tiles allow
    n = int(whole["sample_tiles"].sum())
    assert all(p["num_tiles"] == n for p in parts)
    got = [p["pixel_values"][:, 0, 0, 0].tolist() for p, r in zip(parts, tile_ranges(n, cp)) if len(r)]
    assert sum(got, []) == list(range(n))


def test_tile_ranges_are_even():
    for n in range(0, 20):
        for cp in (1, 2, 3, 4, 8):
            sizes = [len(r) for r in tile_ranges(n, cp)]
            assert sum(sizes) == n and max(sizes) == math.ceil(n / cp) and max(sizes) - min(sizes) <= 1


def isf_groups():
    from omnibal_ext.data.search import SearchConfig, run_isf
    from omnibal_ext.data.stats import load_stats

    stats = load_stats(STATS_FILES)
    plan = run_isf(stats.vit, stats.tokens, SearchConfig(dp_size=8, samples_per_group=4, seed=0))
    return [(stats.tokens[g], int(stats.vit[g].sum())) for g in plan.grouping.groups()]


@pytest.fixture(scope="module")
def groups():
    return isf_groups()


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_balance_on_the_published_stats(groups, cp):
    """Every ISF group of the published stats (ai2d, chartqa, docvqa): the busiest CP rank's attended pairs
    of real tokens within 10% of the mean (pads included, every rank computes the same), its tiles at most
    ceil(tiles / CP)."""
    worst = 0.0
    for lengths, tiles in groups:
        pairs, rank_tiles = rank_work(lengths, tiles, cp)
        worst = max(worst, max(pairs) / (sum(pairs) / cp))
        assert max(rank_tiles) <= math.ceil(tiles / cp)
        computed, _ = rank_work(lengths, tiles, cp, real_only=False)
        assert len(set(computed)) == 1
    assert worst <= 1.10, worst


def test_collate_pads_segments_not_the_row_under_cp_and_sp():
    """--sequence-parallel with CP: the collate adds no row padding segment (each segment is padded to 2 x CP x TP
    by the split instead)."""
    from megatron.vlm.stage.batches import Collate, StageInputs

    got = Collate(PAD, True, StageInputs.everything(), None, pad_to_multiple=2, cp=2, cp_rank=1)(samples())
    assert got.packing.cu_seqlens.tolist() == [0, 8, 16, 24]  # 7, 3 and 5 tokens each padded to 2 x CP x TP = 8

    def rank_part(values, fill, cp=2, rank=1, multiple=8):
        """By hand: each sample padded to ``multiple`` with ``fill``, cut into 2 x CP chunks, the rank's chunks
        ``rank`` and ``2 CP - 1 - rank`` (the load-balanced split), the samples in a row."""
        out = []
        for v in values:
            v = v + [fill] * (-len(v) % multiple)
            c = len(v) // (2 * cp)
            out += v[rank * c:(rank + 1) * c] + v[(2 * cp - 1 - rank) * c:(2 * cp - rank) * c]
        return out

    ids = [s["input_ids"].tolist() for s in samples()]
    assert got.text.tokens[0].tolist() == rank_part(ids, PAD) == [9, 2, 3, 4, 8, 0, 0, 0, 11, 12, 13, 0]
    assert got.text.labels[0].tolist() == rank_part([[i + 100 for i in x] for x in ids], -100)


@pytest.mark.parametrize("cp,sp_tp", [(2, 1), (3, 1), (4, 1), (2, 2), (2, 4)])
def test_planner_arithmetic_equals_the_split(cp, sp_tp):
    """omnibal_ext's tensor-free figures (``cp_split``, ``MicroBatchShape.cp``: what the planner counts) equal what
    ``split_batch`` gives each rank, on random packed micro-batches: tokens, attended pairs (pads included, and
    real only through ``rank_work``) and tiles."""
    import numpy as np

    from omnibal_ext.model import cp_split
    from omnibal_ext.model.cost_model import MicroBatchShape

    rng = np.random.default_rng(cp)
    for _ in range(20):
        lengths = rng.integers(1, 40, rng.integers(1, 6)).tolist()
        tiles = rng.integers(0, 4, len(lengths)).tolist()
        batch_samples, first = [], 0
        for n, t in zip(lengths, tiles):
            ids = torch.tensor(rng.integers(1, 50, n))  # no PAD (0) among real tokens
            k = max(t, 1)  # text-only samples carry a dummy tile
            pix = torch.arange(first, first + k, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 2, 2)
            first += k
            batch_samples.append({"input_ids": ids, "labels": ids + 100, "image_flags": torch.tensor([1] * t or [0]),
                                  "pixel_values": pix})
        whole = collate_packed(batch_samples, PAD)
        n_tiles = int(whole["sample_tiles"].sum())
        parts = [split_batch(whole, cp, r, PAD, None, sp_tp=sp_tp) for r in range(cp)]
        padded = cp_split.padded_lengths(lengths, cp, sp_tp)
        shape = MicroBatchShape(n_tiles, int(padded.sum()), llm_attn_tokens_sq=float((padded ** 2).sum()), cp=cp)
        assert parts[0]["cu_seqlens"].tolist() == [0] + np.cumsum(padded).tolist()
        pairs_all = int(cp_split.rank_pairs_padded(lengths, cp, sp_tp).sum())
        real_pairs, rank_tiles = rank_work(lengths, n_tiles, cp, sp_tp=sp_tp)
        for r, p in enumerate(parts):
            pos = p["position_ids"][0]
            assert pos.numel() == shape.rank_llm_tokens
            got_all = int((pos + 1).sum())  # causal within the padded segment: position + 1 keys per query
            assert got_all == pairs_all == rank_work(lengths, n_tiles, cp, real_only=False, sp_tp=sp_tp)[0][r]
            assert 2 * got_all == shape.rank_attn_tokens_sq + shape.rank_llm_tokens  # P^2/cp + P/cp, summed
            assert int(((pos + 1) * (p["tokens"][0] != PAD)).sum()) == real_pairs[r]
            assert min(p["pixel_values"].shape[0], len(tile_ranges(n_tiles, cp)[r])) == rank_tiles[r]
        assert max(rank_tiles) == shape.rank_vision_items
