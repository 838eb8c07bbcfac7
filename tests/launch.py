"""Run pretrain_vlm.py from tests: scripts/benchlib.py's launcher, read back its JSON-lines log."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402


def run_training(nproc: int, flags: list[str], workdir: Path, name: str, timeout: int = 600,
                 expect_ok: bool = True, **launch) -> tuple[list[dict], str]:
    """torchrun pretrain_vlm.py with ``flags``; returns (JSON log records of training iterations, output).
    ``launch``: benchlib.run_trainer's torchrun_flags and env."""
    run = benchlib.run_trainer(flags, workdir, name, nproc=nproc, timeout=timeout, check=False, **launch)
    if expect_ok and not run.ok:
        raise AssertionError(f"{name} failed ({run.returncode}):\n{run.error_tail(6000)}")
    return run.records, run.output


def run_single(flags: list[str], workdir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Plain `python pretrain_vlm.py` (a world of one), for error paths."""
    cmd = [sys.executable, str(ROOT / "pretrain_vlm.py"), *flags]
    return subprocess.run(cmd, cwd=workdir, env=benchlib.trainer_env(), capture_output=True, text=True,
                          timeout=timeout)


def checkpoint_tensors(folder: Path) -> dict:
    """The model tensors (not optimizer state, RNG or extra state) of a checkpoint folder, by key, whole,
    read by the checkpoint module's own reader."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron.training.checkpointing import read_global_tensors

    keys = [k for k, m in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items()
            if hasattr(m, "size") and not k.startswith(("optimizer.", "rng_state")) and "_extra_state" not in k]
    return read_global_tensors(str(folder), keys)
