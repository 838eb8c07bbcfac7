"""The stats-matched synthetic dataset: every sample has the tiles and tokens the length rule intends,
as the trainer's reader (RecordDataset) counts them."""
import gzip
import json
import os

import numpy as np
import pytest

from conftest import STATS_FILES
from megatron.vlm.data import RecordDataset, TileImages
from megatron.vlm.data.synthetic import LengthRule, build_stats_matched_dataset, draw_records
from megatron.vlm.data.tokenizer import build_tokenizer
from omnibal_ext.errors import UserError

STATS = STATS_FILES


def expected(k, n, scale, tpt_model=4, max_tokens=None):
    """Direct formula: k images of one tile, text = scaled non-image tokens, at least the byte
    template (22) + <img></img>\\n per image + a 1-byte answer."""
    text = round(scale * max(n - 256 * k, 0))
    if max_tokens is not None:
        text = min(text, max_tokens - tpt_model * k)
    text = max(text, 22 + 3 * k + 1)
    return max(k, 1), k * tpt_model + text


def read(meta, max_num_tiles=6):
    return RecordDataset(meta, build_tokenizer(None), TileImages(image_size=32, tokens_per_tile=4,
                                                                 max_num_tiles=max_num_tiles))


@pytest.fixture
def edge_stats(tmp_path):
    records = [{"vit_num": 0, "token_num": 300}, {"vit_num": 1, "token_num": 256 + 100},
               {"vit_num": 7, "token_num": 7 * 256 + 41}, {"vit_num": 3, "token_num": 100},  # fewer than 256 k
               {"vit_num": 2, "token_num": 2 * 256 + 2000}, {"vit_num": 5, "token_num": 5 * 256 + 1}]
    path = tmp_path / "edge.json"
    path.write_text(json.dumps(records))
    return path, records


@pytest.mark.parametrize("scale,max_tokens", [(1.0, None), (0.5, None), (1.0, 300)])
def test_edge_records_follow_the_formula(tmp_path, edge_stats, scale, max_tokens):
    path, records = edge_stats
    meta = build_stats_matched_dataset([path], str(tmp_path / "ds"), num_samples=12, tile_size=32,
                                       text_scale=scale, seed=3, max_tokens=max_tokens)
    ds = read(meta)
    tokens, tiles = ds.sample_lengths()
    lines = [json.loads(x) for x in open(os.path.join(os.path.dirname(meta), "train.jsonl"))]
    assert len(lines) == len(ds) == 12
    # two passes over 6 records: each record used exactly twice
    assert sorted(r["stats_index"] for r in lines) == sorted(list(range(6)) * 2)
    for i, rec in enumerate(lines):
        src = records[rec["stats_index"]]
        assert (rec["vit_num"], rec["token_num"]) == (src["vit_num"], src["token_num"])
        assert (tiles[i], tokens[i]) == expected(src["vit_num"], src["token_num"], scale, max_tokens=max_tokens)
        assert ds.sample_real_items()[i] == src["vit_num"]  # real tiles; text-only gets a dummy one
    # materialised samples agree with the counts
    for i in range(len(ds)):
        item = ds[i]
        assert item["pixel_values"].shape[0] == tiles[i] and len(item["input_ids"]) == tokens[i]
        assert (item["labels"] != -100).any()  # every sample has an answer to learn


def test_max_num_tiles_does_not_change_tiles(tmp_path, edge_stats):
    path, records = edge_stats
    meta = build_stats_matched_dataset([path], str(tmp_path / "ds"), num_samples=6, tile_size=32)
    for mnt in (1, 2, 6, 12):
        _, tiles = read(meta, mnt).sample_lengths()
        lines = [json.loads(x) for x in open(os.path.join(os.path.dirname(meta), "train.jsonl"))]
        assert tiles.tolist() == [max(r["vit_num"], 1) for r in lines]


def test_real_stats_files(tmp_path):
    assert len(STATS) == 3, STATS  # the shipped ai2d, chartqa and docvqa stats
    meta = build_stats_matched_dataset(STATS, str(tmp_path / "ds"), num_samples=80, tile_size=32, seed=1)
    tokens, tiles = read(meta).sample_lengths()
    all_records = []
    for f in STATS:
        with gzip.open(f, "rt") as fh:
            all_records += json.load(fh)
    lines = [json.loads(x) for x in open(os.path.join(os.path.dirname(meta), "train.jsonl"))]
    assert len(set(r["stats_index"] for r in lines)) == 80  # fewer samples than records: no repeats
    for i, rec in enumerate(lines):
        src = all_records[rec["stats_index"]]
        assert rec["stats_file"] in {f.name for f in STATS}
        assert (tiles[i], tokens[i]) == expected(src["vit_num"], src["token_num"], 1.0)
    # the rule of LengthRule agrees with the formula too
    rule = LengthRule()
    k = np.array([r["vit_num"] for r in lines])
    n = np.array([r["token_num"] for r in lines])
    assert (rule.tokens(k, n) == tokens).all() and (rule.tiles(k) == tiles).all()


def test_idempotent_and_refuses_other_params(tmp_path, edge_stats):
    path, _ = edge_stats
    out = str(tmp_path / "ds")
    meta = build_stats_matched_dataset([path], out, num_samples=6, tile_size=32)
    marker = os.path.join(out, ".complete.json")
    stamp = os.stat(marker).st_mtime_ns
    assert build_stats_matched_dataset([path], out, num_samples=6, tile_size=32) == meta
    assert os.stat(marker).st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(UserError):
        build_stats_matched_dataset([path], out, num_samples=7, tile_size=32)


def test_draw_is_prefix_stable_and_covers_records():
    a, b = draw_records(10, 25, seed=4), draw_records(10, 7, seed=4)
    assert (a[:7] == b).all()
    assert sorted(a[:10]) == list(range(10)) and sorted(a[10:20]) == list(range(10))


def test_bad_input_names_the_problem(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"vit_num": 1}]))
    with pytest.raises(ValueError, match="bad.json"):
        build_stats_matched_dataset([bad], str(tmp_path / "ds"), num_samples=2, tile_size=32)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        build_stats_matched_dataset([tmp_path / "missing.json"], str(tmp_path / "ds2"), 2, 32)
    with pytest.raises(ValueError, match="text_scale"):
        LengthRule(text_scale=0)
