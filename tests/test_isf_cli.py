"""``omnibal isf stats|search|pack`` in-process, and ISF on the real stats shipped in data/omnibal_stats/."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omnibal_cli import main
from omnibal_ext.data.assign import load_pack
from omnibal_ext.data.isf import check_partition
from omnibal_ext.data.sampler import GroupBatchSampler
from omnibal_ext.data.search import SearchConfig, run_isf, random_baseline
from omnibal_ext.data.stats import load_stats

from conftest import STATS_FILES

METRICS = {"pad_ratio", "dist_ratio_llm", "dist_ratio_vit", "fill_llm", "fill_vit", "samples_per_group"}


def stats_file(path: Path, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    tiles = np.where(rng.random(n) < 0.25, rng.choice([0, 1], n), rng.integers(1, 10, n))
    tokens = rng.integers(20, 800, n) + 256 * tiles
    path.write_text(json.dumps([{"vit_num": int(v), "token_num": int(t), "image_flags": int(v)}
                                for v, t in zip(tiles, tokens)]))
    return str(path)


def test_search_json_contract(tmp_path, capsys):
    a, b = stats_file(tmp_path / "a.json", 2500, 1), stats_file(tmp_path / "b.json", 1500, 2)
    out = tmp_path / "out.json"
    png = tmp_path / "steps.png"
    rc = main(["isf", "search", "--stats", a, b, "--dp", "4", "--samples-per-group", "4", "--json", str(out),
               "--max-candidates", "6", "--plot", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    for key in ("samples_in", "samples_out", "groups", "seconds", "params", "isf", "random"):
        assert key in doc
    assert doc["samples_in"] == doc["samples_out"] == 4000
    assert {"qv", "qt", "qv_min", "qt_min", "iters"} <= set(doc["params"])
    assert METRICS <= set(doc["isf"]) and METRICS <= set(doc["random"])
    assert doc["random"]["samples_per_group"] == pytest.approx(4.0)
    assert doc["isf"]["dist_ratio_llm"] < doc["random"]["dist_ratio_llm"]
    assert doc["isf"]["dist_ratio_vit"] < doc["random"]["dist_ratio_vit"]
    assert 1 <= len(doc["search"]["candidates"]) <= 6
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "random" in capsys.readouterr().out


def test_search_per_source_and_fixed_params(tmp_path):
    a, b = stats_file(tmp_path / "a.json", 800, 3), stats_file(tmp_path / "b.json", 600, 4)
    out = tmp_path / "o.json"
    assert main(["isf", "search", "--stats", a, b, "--dp", "2", "--per-source", "--max-candidates", "3",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["params"]["per_group"]) == {"0", "1"} and doc["samples_out"] == 1400
    assert main(["isf", "search", "--stats", a, "--dp", "2", "--qt", "9000", "--qv", "40", "--qt-min", "8000",
                 "--qv-min", "36", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["params"]["qt"], doc["params"]["qv"], doc["params"]["qt_min"], doc["params"]["qv_min"]) == \
        (9000, 40, 8000, 36)
    assert doc["search"] is None


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_pack_roundtrip_feeds_the_sampler(tmp_path, suffix):
    a = stats_file(tmp_path / "a.json", 1200, 5)
    pack = tmp_path / f"pack{suffix}"
    assert main(["isf", "pack", "--stats", a, "--dp", "4", "--out", str(pack), "--max-candidates", "4"]) == 0
    plan = load_pack(pack)
    assert plan.dp_size == 4 and plan.meta["num_samples"] == 1200
    flat = np.concatenate(plan.groups)
    assert sorted(flat.tolist()) == list(range(1200))
    stats = load_stats([a])
    assert [int(stats.tokens[g].sum()) for g in plan.groups] == plan.group_tokens.tolist()
    G = len(plan.groups)
    served = []
    for r in range(4):
        smp = GroupBatchSampler(plan, 4, r, seed=0, num_steps=-(-G // 4))
        served += [s for b in smp for s in b]
    assert len(served) >= 1200 and set(served) == set(range(1200))


def test_bad_stats_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"vit_num": 1, "token_num": 3}, {"token_num": 3}]))
    assert main(["isf", "stats", "--stats", str(bad)]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "record 1" in err


def test_stats_command(tmp_path, capsys):
    a = stats_file(tmp_path / "a.json", 100, 6)
    out = tmp_path / "s.json"
    assert main(["isf", "stats", "--stats", a, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["all"]["samples"] == 100


def test_isf_beats_random_on_shipped_stats():
    assert len(STATS_FILES) == 3, STATS_FILES
    stats = load_stats(STATS_FILES)
    plan = run_isf(stats.vit, stats.tokens, SearchConfig(dp_size=8, samples_per_group=4))
    check_partition(plan.grouping, len(stats))
    rnd = random_baseline(stats.vit, stats.tokens, 8, 4)
    m = plan.metrics
    assert rnd["dist_ratio_llm"] > 0.1 and rnd["dist_ratio_vit"] > 0.1
    assert m["dist_ratio_llm"] < rnd["dist_ratio_llm"] and m["dist_ratio_vit"] < rnd["dist_ratio_vit"]
    # the targets: both DistRatios <= 0.02 at token fill >= 0.95, about 4 samples per group
    assert m["dist_ratio_llm"] <= 0.02 and m["dist_ratio_vit"] <= 0.02 and m["fill_llm"] >= 0.95
    assert 3.5 <= m["samples_per_group"] <= 5.0
