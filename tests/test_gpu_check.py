"""scripts/gpu_check.py without CUDA: exits 0, says so, writes every check, the CUDA ones (fp32 parity included: its
CPU halves compare with the CUDA ones) skipped with reasons, the CPU parts (THD vs the dense mask, CP2 vs serial on
gloo) run and checked."""
import json
import subprocess
import sys

import pytest
import torch

from launch import ROOT, benchlib

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_gpu_check_cpu_path(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out),
                           "--work", str(tmp_path / "work")], env=benchlib.trainer_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA device" in proc.stdout
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
        assert line in proc.stdout  # the printed table


def test_cp_check_picks_cuda_only_with_a_device_per_rank():
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check import cp_check_device

    assert cp_check_device(True, 2)[0] == "cuda" and cp_check_device(True, 8)[0] == "cuda"
    assert cp_check_device(True, 1)[0] == "cpu" and "NCCL needs one per CP rank" in cp_check_device(True, 1)[1]
    assert cp_check_device(False, 0) == ("cpu", "no CUDA device: CP2 ran on the CPU (gloo)")
