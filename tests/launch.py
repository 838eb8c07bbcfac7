"""Run the trainer from tests: in a worker pool (``tests/pool.py``) by default, in fresh processes for what needs them
(torchrun's restarts, ``OMNIBAL_FAULT``, a command's own exit path); read back its JSON-lines log."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402

import pool  # noqa: E402

TRAINER = "pretrain_vlm:cli"  # the trainer's command-line entry point, as a pool case calls it


def needs_fresh(torchrun_flags=(), env: dict | None = None) -> bool:
    """Whether a launch needs fresh processes: torchrun's agent (restarts) or an injected fault (a rank that kills
    itself, stalls or exits) would take a pool down."""
    return bool(torchrun_flags) or any(k.startswith("OMNIBAL_FAULT") for k in (env or {}))


def run_trainer(flags: list[str], workdir: str | os.PathLike, name: str, nproc: int = 2, timeout: int = 3600,
                check: bool = True, threads: int = 1, torchrun_flags: tuple[str, ...] = (),
                env: dict | None = None, kill_in_pool: bool = False) -> benchlib.RunResult:
    """``benchlib.run_trainer``'s contract (``pretrain_vlm.py --json-log workdir/name.jsonl *flags`` on ``nproc``
    ranks in ``workdir``), in the worker pool of ``nproc`` ranks unless the launch needs fresh processes
    (``needs_fresh``, or more than one thread per rank). ``kill_in_pool``: an ``OMNIBAL_FAULT`` kill runs in the pool
    all the same (the killed rank takes the pool down, which restarts for the next case: a crashed run and its
    resume without torchrun's restart, half the process starts). The benchmarks' tests put it in benchlib's place."""
    fault_outside_pool = needs_fresh(env=env) and not kill_in_pool
    if torchrun_flags or fault_outside_pool or threads != 1:
        return benchlib.run_trainer(flags, workdir, name, nproc, timeout, check, threads, torchrun_flags, env)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.jsonl"
    log.unlink(missing_ok=True)
    run = pool.run_case(TRAINER, ["--json-log", str(log), *flags], nproc, workdir, env, timeout)
    result = benchlib.read_run(name, flags, workdir, run.returncode, run.output, run.wall_s)
    if check and not result.ok:
        raise RuntimeError(f"trainer run {name} failed ({result.returncode}):\n{result.error_tail()}")
    return result


def run_training(nproc: int, flags: list[str], workdir: Path, name: str, timeout: int = 600,
                 expect_ok: bool = True, **launch) -> tuple[list[dict], str]:
    """``run_trainer`` of ``flags`` on ``nproc`` ranks; returns (JSON log records of training iterations, output).
    ``launch``: ``torchrun_flags``, ``env`` (extra environment variables) and ``kill_in_pool``."""
    run = run_trainer(flags, workdir, name, nproc, timeout, check=False, **launch)
    if expect_ok and not run.ok:
        raise AssertionError(f"{name} failed ({run.returncode}):\n{run.error_tail(6000)}")
    return run.records, run.output


def run_single(flags: list[str], workdir: Path, timeout: int = 300, fresh: bool = False
               ) -> subprocess.CompletedProcess:
    """The trainer as a world of one (``python pretrain_vlm.py *flags`` in ``workdir``), for error paths: its exit
    status, standard output and error. In the pool of one rank; ``fresh``: the real command in a new process (the
    exit status and output the command line gives)."""
    if fresh:
        cmd = [sys.executable, str(ROOT / "pretrain_vlm.py"), *flags]
        return subprocess.run(cmd, cwd=workdir, env=benchlib.trainer_env(), capture_output=True, text=True,
                              timeout=timeout)
    run = pool.run_case(TRAINER, flags, 1, workdir, timeout=timeout)
    return subprocess.CompletedProcess([TRAINER, *flags], run.returncode, "".join(run.stdout), "".join(run.stderr))


def checkpoint_tensors(folder: Path) -> dict:
    """The model tensors (not optimizer state, RNG or extra state) of a checkpoint folder, by key, whole,
    read by the checkpoint module's own reader."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron.training.checkpointing import read_global_tensors

    keys = [k for k, m in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items()
            if hasattr(m, "size") and not k.startswith(("optimizer.", "rng_state")) and "_extra_state" not in k]
    return read_global_tensors(str(folder), keys)
