"""scripts/bench_generate.py on tiny inputs: it runs ours and transformers' generate side by side, at batch 1 and 8,
and both give the same greedy tokens (the benchmark measures the same work). Its ``main`` runs as a case of the worker
pool of one rank (``tests/pool.py``), not a fresh process."""
import json

import pytest

import pool

pytest.importorskip("transformers")


@pytest.mark.bench
def test_bench_generate_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run = pool.run_case("bench_generate:main", ["--quick", "--new-tokens", "4", "--repeats", "1", "--json", str(out)],
                        1, tmp_path, timeout=900)
    assert run.returncode == 0, run.output[-6000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 8]
    for r in rows:
        assert r["same_tokens"], r
        assert r["ours_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0 and r["ours_ttft_ms"] > 0
    assert "| batch | prompt tokens |" in run.output
