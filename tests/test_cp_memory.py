"""Context parallelism's activation memory: what one CP rank's autograd saves (scripts/check_cp_memory.py: the whole
tiny model as one stage, fp32, 8 tiles and 1024 LLM tokens in samples of 256) against the memory model
(``MicroBatchShape.cp``) on the CPU's kernels."""
import json
import re

import pytest

import pool


def _check(tmp_path, cp: int) -> list[dict]:
    """scripts/check_cp_memory.py's ``main`` on ``cp`` ranks (the worker pool of that size)."""
    run = pool.run_case("check_cp_memory:main", ["--context-parallel-size", str(cp)], cp, tmp_path, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    # the ranks print one JSON object each
    rows = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", "".join(run.stdout))]
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
