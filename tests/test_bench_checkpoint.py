"""scripts/bench_checkpoint.py --quick: the JSON contract (tiny model, one round, both formats), its ``main`` a case of
the worker pool of one rank."""
import json

import pytest

import pool

TIMES = ["ours_save_save_s", "base_save_save_s", "ours_load_load_s", "ours_load_verify_s", "base_load_load_s",
         "first_save_s", "ours_save_dist_save_s", "ours_save_manifest_s"]
RATIOS = ["save_ratio", "load_ratio", "bytes_ratio"]


@pytest.mark.bench
def test_bench_checkpoint_quick(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = pool.run_case("bench_checkpoint:main", ["--quick", "--json", str(out), "--workdir", str(tmp_path / "work")],
                         1, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.output[-6000:]
    res = json.loads(out.read_text())
    assert res["quick"] and res["repeats"] == 1
    [row] = res["cases"]
    assert row["case"] == "tiny" and row["optimizer"] == "adam" and row["world"] == 1
    missing = set(TIMES + RATIOS + ["bytes_ours", "bytes_base", "per_rank", "params"]) - set(row)
    assert not missing, missing
    for k in TIMES:
        assert row[k] > 0, k
    assert row["bytes_ours"] > 0 and row["bytes_base"] > 0
    assert row["bytes_ours_per_rank"] == [row["bytes_ours"]] and row["bytes_base_per_rank"] == [row["bytes_base"]]
    for k in RATIOS:
        assert row[k] > 0, k
    assert sum(row["params"].values()) > 0
    assert res["targets"] and "save ours" in proc.output  # the printed table
    assert not (tmp_path / "work" / "tiny_adam_ours").exists()  # checkpoints removed after each round
