"""ISF in the trainer: DP=2 on CPU, one packed group per micro-batch, ratios logged."""
import pytest

from launch import run_training

pytestmark = pytest.mark.slow


def test_isf_dp2_trains_and_logs_balance(tmp_path, data_cache):
    flags = ["--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "2e-3",
             "--omnibal-isf", "--data-cache-dir", str(data_cache), "--seed", "3", "--eval-interval", "0"]
    records, out = run_training(2, flags, tmp_path, "isf")
    assert "> ISF: " in out
    assert [r["iteration"] for r in records] == list(range(1, 7))
    for r in records:
        assert r["pad ratio"] == 0.0  # packed: no padding inside a device
        assert 0.0 <= r["dist ratio llm"] < 0.2 and 0.0 <= r["dist ratio vit"] < 0.5
    assert records[-1]["lm loss"] < records[0]["lm loss"]
    baseline, _ = run_training(2, [f for f in flags if f != "--omnibal-isf"], tmp_path, "random")
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(baseline, "pad ratio") > 0.05
    assert mean(records, "dist ratio llm") < mean(baseline, "dist ratio llm")
