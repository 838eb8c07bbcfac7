"""scripts/bench_generate.py on tiny inputs: it runs ours and transformers' generate side by side, at batch 1 and 8,
and both give the same greedy tokens (the benchmark measures the same work)."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("transformers")


@pytest.mark.bench
def test_bench_generate_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchlib

    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_generate.py"), "--quick", "--new-tokens", "4",
                          "--repeats", "1", "--json", str(out)], env=benchlib.trainer_env(), capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 8]
    for r in rows:
        assert r["same_tokens"], r
        assert r["ours_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0 and r["ours_ttft_ms"] > 0
    assert "| batch | prompt tokens |" in run.stdout
