"""Run pretrain_vlm.py under torchrun from tests and read back its JSON-lines log."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# set by an in-process process group of an earlier test; a child must pick its own
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    e.setdefault("PYTHONWARNINGS", "ignore")
    return e


def run_training(nproc: int, flags: list[str], workdir: Path, name: str, timeout: int = 600,
                 expect_ok: bool = True) -> tuple[list[dict], str]:
    """torchrun pretrain_vlm.py with ``flags``; returns (JSON log records of training iterations, output)."""
    log = workdir / f"{name}.jsonl"
    if log.exists():
        log.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "pretrain_vlm.py"), "--json-log", str(log), *flags]
    proc = subprocess.run(cmd, cwd=workdir, env=env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{out[-6000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [r for r in records if not r["prefix"]], out


def run_single(flags: list[str], workdir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Plain `python pretrain_vlm.py` (a world of one), for error paths."""
    cmd = [sys.executable, str(ROOT / "pretrain_vlm.py"), *flags]
    return subprocess.run(cmd, cwd=workdir, env=env(), capture_output=True, text=True, timeout=timeout)
