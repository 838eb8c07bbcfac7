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
    baseline, out = run_training(2, [f for f in flags if f != "--omnibal-isf"], tmp_path, "random")
    assert "> data: the scan of" in out  # the first run's validation scan, read back (no image decoded again)
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(baseline, "pad ratio") > 0.05
    assert mean(records, "dist ratio llm") < mean(baseline, "dist ratio llm")


def test_profile_at_launch_uses_the_isf_groups(tmp_path, data_cache):
    """Under --omnibal-isf the launch profile times the mean ISF group and sizes memory at the caps Qv/Qt that
    the ISF plan printed (it once ran before the plan and used padded random micro-batches instead)."""
    import ast
    import json
    import re

    from launch import run_single

    profile = tmp_path / "profile.json"
    proc = run_single(["--omnibal-isf", "--micro-batch-size", "4", "--global-batch-size", "8",
                       "--data-cache-dir", str(data_cache), "--omnibal-profile", str(profile)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    caps = ast.literal_eval(re.search(r"> ISF: .* params (\{[^}]*\})", proc.stdout).group(1))
    meta = json.loads(profile.read_text())["meta"]
    assert (meta["memory_shape"]["vision_items"], meta["memory_shape"]["llm_tokens"]) == (caps["qv"], caps["qt"])
    assert meta["shape"]["llm_tokens"] < caps["qt"]  # the mean group, below the cap
