"""Checkpoints: one file per rank holding model, optimizer, LR scheduler, RNG and data position.

Layout (Megatron-like)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000006/rank_00003.pt

A checkpoint resumes under the same parallel sizes it was saved with; anything else is refused
with the sizes named (re-sharding is not implemented).
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def _rank_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", f"rank_{rank:05d}.pt")


def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, extra: dict) -> None:
    rank = dist.get_rank()
    path = _rank_file(root, iteration, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "model": [m.module.state_dict() if hasattr(m, "module") else m.state_dict() for m in model],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        **extra,
    }, path)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def load_checkpoint(root: str, model, optimizer, scheduler, parallel: dict) -> dict:
    """Restore everything saved by :func:`save_checkpoint`; returns the saved extras."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        raise FileNotFoundError(f"--load {root}: no {TRACKER} there (nothing saved yet?)")
    with open(tracker) as f:
        iteration = int(f.read().strip())
    path = _rank_file(root, iteration, dist.get_rank())
    if not os.path.exists(path):
        raise FileNotFoundError(f"--load {root}: {path} is missing (saved with another world size?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state.get("parallel", {})
    if saved != parallel:
        raise ValueError(f"--load {root}: checkpoint was saved with {saved}, this run is {parallel}")
    for m, sd in zip(model, state["model"]):
        (m.module if hasattr(m, "module") else m).load_state_dict(sd)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
