"""scripts/gpu_check.py without CUDA: exits 0, says so, writes every check, the CUDA ones (fp32 parity included: its
CPU halves compare with the CUDA ones) skipped with reasons, the CPU parts (THD vs the dense mask, CP2 vs serial on
gloo) run and checked.

Its ``main`` runs here with each check in this process (``_child``, what its child process runs) rather than a child
process per check, THD's (which starts a megatron world) in the worker pool of one rank, and its trainer runs served by
the session's canonical runs (the serial one) and the pool of two (CP2) instead of fresh processes."""
import json
import sys

import pytest
import torch

import pool
from launch import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_gpu_check_cpu_path(tmp_path, monkeypatch, canonical_runs, data_cache, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    def run_check(name: str, work, timeout: float) -> dict:
        out = work / f"{name}.result.json"
        if name == "thd_vs_dense":
            argv = ["--child", name, "--child-out", str(out), "--work", str(work), "--timeout", str(timeout)]
            run = pool.run_case("gpu_check:main", argv, 1, work, timeout=timeout)
            assert run.returncode == 0, run.output[-3000:]
        else:
            gpu_check._child(name, out, work, timeout)
        return json.loads(out.read_text())

    def run_trainer(work, name, flags, timeout, nproc=1):
        return canonical_runs.records(nproc, [*flags, "--data-cache-dir", str(data_cache)]), [], ""

    monkeypatch.setattr(gpu_check, "run_check", run_check)
    monkeypatch.setattr(gpu_check, "run_trainer", run_trainer)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out), "--work", str(tmp_path / "work")]) == 0
    stdout = capsys.readouterr().out
    assert "no CUDA device" in stdout
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert list(checks) == ["fp32_parity", "bf16_learns", "te_vs_local", "thd_vs_dense", "cp_attention",
                            "layer_throughput", "e2e_cut", "fla_delta_rule"]
    for name in ("fp32_parity", "bf16_learns", "te_vs_local", "layer_throughput", "e2e_cut", "fla_delta_rule"):
        assert checks[name]["status"] == "skipped" and checks[name]["reason"], (name, checks[name])
    assert "variants" not in checks["fp32_parity"]  # no trainer run without a CUDA half to compare with
    assert checks["thd_vs_dense"]["status"] == "pass" and checks["thd_vs_dense"]["max_rel_err"] < 1e-4
    # context parallelism's CPU half: CP2 (2 processes, gloo) against the serial run, 5 losses each
    cp = checks["cp_attention"]
    assert cp["status"] == "pass" and cp["device"] == "cpu" and len(cp["cp2_losses"]) == 5, cp
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(cp["cp2_losses"], cp["serial_losses"]))
    assert cp["serial_losses"][4] < cp["serial_losses"][0]  # the serial reference learns
    for line in ("fp32_parity", "thd_vs_dense", "cp_attention"):
        assert line in stdout  # the printed table


def test_cp_check_picks_cuda_only_with_a_device_per_rank():
    from gpu_check import cp_check_device

    assert cp_check_device(True, 2)[0] == "cuda" and cp_check_device(True, 8)[0] == "cuda"
    assert cp_check_device(True, 1)[0] == "cpu" and "NCCL needs one per CP rank" in cp_check_device(True, 1)[1]
    assert cp_check_device(False, 0) == ("cpu", "no CUDA device: CP2 ran on the CPU (gloo)")
