"""Smoke runs of the online ISF benchmark and the JSONL startup benchmark on tiny inputs: the pipeline runs and
writes its JSON with every row (the figures themselves come from the full runs in docs/results.md)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.mark.bench
def test_bench_online_isf_quick(tmp_path):
    import bench_online_isf

    assert bench_online_isf.main(["--quick", "--json", str(tmp_path / "online.json")]) == 0
    out = json.loads((tmp_path / "online.json").read_text())
    assert out["loader"]["samples_per_s"] > 0 and out["loader"]["encoded_bytes_per_sample"] > 0
    for name in ("internvl", "video_mix"):
        rows = out["datasets"][name]["rows"]
        assert [r["method"] for r in rows] == ["random", "energon-ffd", "knapsack-vt", "offline-isf", "online-isf-16"]
        by = {r["method"]: r for r in rows}
        assert by["online-isf-16"]["plan_ms_mean"] > 0 and by["online-isf-16"]["pad_ratio_time"] == 0.0
        windows = by["online-isf-16"]["windows"]  # the balance over time, per window of steps
        assert windows[0]["first_step"] == 0 and sum(w["steps"] for w in windows) == by["online-isf-16"]["slots"]
        # packed, coordinated groups against independent random micro-batches of the same data
        assert by["online-isf-16"]["dist_ratio_time"] < by["random"]["dist_ratio_time"]
        assert by["random"]["pad_ratio_time"] > 0
    cp = out["datasets"]["video_mix"]["cp"]
    assert [r["method"] for r in cp] == ["random", "online-isf-16"]
    assert cp[1]["cp_vit_split_excess"] < cp[0]["cp_vit_split_excess"]
    assert len(out["targets"]) == 8


@pytest.mark.bench
@pytest.mark.slow
def test_bench_jsonl_startup_tiny(tmp_path):
    import bench_jsonl_startup

    result = bench_jsonl_startup.main(["--sizes", "40", "--pool", "4", "--image-px", "64", "96",
                                       "--out", str(tmp_path), "--json", str(tmp_path / "startup.json")])
    row = result["rows"][0]
    assert row["records"] == 40 and row["cold_s"] > 0 and row["cached_s"] > 0
    assert not row["cold_read_cache"] and row["cached_read_cache"]  # the second launch read the first one's scan
    assert json.loads((tmp_path / "startup.json").read_text())["rows"][0]["records"] == 40
