"""Context parallelism's activation memory: what one CP rank's autograd saves (scripts/check_cp_memory.py: the whole
tiny model as one stage, fp32, 8 tiles and 1024 LLM tokens in samples of 256) against the memory model
(``MicroBatchShape.cp``) on the CPU's kernels."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402


def _check(tmp_path, cp: int) -> list[dict]:
    script = str(ROOT / "scripts" / "check_cp_memory.py")
    cmd = [sys.executable, script] if cp == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-addr", "127.0.0.1",
         "--master-port", str(benchlib.free_port()), script, "--context-parallel-size", str(cp)]
    run = subprocess.run(cmd, cwd=tmp_path, env=benchlib.trainer_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    # the ranks print one JSON object each; two may share a line of the merged output
    rows = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", run.stdout)]
    assert sorted(r["rank"] for r in rows) == list(range(cp)), run.stdout
    return rows


@pytest.mark.slow
def test_cp2_activation_bytes_per_rank_match_the_model(tmp_path):
    """Every rank at CP 2 within 5% of the model's busiest rank (the model counts the rank whose two chunks both
    attend with a mask), CP 1 within 5%, and the measured CP2/CP1 ratio within 5% of the model's."""
    serial = _check(tmp_path, 1)[0]
    ranks = _check(tmp_path, 2)
    for row in [serial, *ranks]:
        print(row)
        assert row["measured_bytes"] == pytest.approx(row["predicted_bytes"], rel=0.05), row
    busiest = max(r["measured_bytes"] for r in ranks)
    assert busiest / serial["measured_bytes"] == pytest.approx(
        ranks[0]["predicted_bytes"] / serial["predicted_bytes"], rel=0.05)
    assert busiest < 0.6 * serial["measured_bytes"]
