"""scripts/bench_data.py --quick: the JSON contract (loader, TP decode, scan and trainer rows), not speed (its
``main`` here, its trainer runs in the worker pools)."""
import json

import pytest


@pytest.mark.bench
def test_bench_data_quick(tmp_path, pooled_benchlib, capsys):
    import bench_data

    out = tmp_path / "data.json"
    bench_data.main(["--quick", "--json", str(out), "--out", str(tmp_path / "runs")])
    res = json.loads(out.read_text())
    assert res["config"]["quick"] and res["config"]["samples"] == 24
    assert [(r["stage"], r["workers"]) for r in res["loader"]] == [
        ("ViT (decodes)", 0), ("ViT (decodes)", 2), ("LLM-only", 0), ("LLM-only", 2)]
    assert all(r["samples_per_s"] > 0 and r["ms_per_batch"] > 0 for r in res["loader"])
    assert [r["mode"] for r in res["tp_decode"]] == ["broadcast", "split", "duplicate"]
    assert all(r["ms_per_batch"] > 0 for r in res["tp_decode"])
    assert [r["scan"] for r in res["scan"]] == ["one process", "split over 2 processes", "read from the scan cache"]
    assert all(r["s"] > 0 for r in res["scan"])
    rows = res["trainer"]
    assert [r["workers"] for r in rows] == [0, 2]
    for r in rows:
        assert r["iterations"] == 3 and r["ms_per_iter"] > 0 and 0 <= r["data_wait_share"] < 1
    assert rows[0]["losses"] == rows[1]["losses"]  # the same batches whatever the workers
    assert "data wait" in capsys.readouterr().out
