"""Checkpoints: one file per rank holding model, optimizer, LR scheduler, RNG and data position.

Layout (Megatron-like)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000006/rank_00003.pt

With the distributed optimizer, megatron-core's ``DistributedOptimizer.state_dict`` holds only the
non-parameter state; each rank also keeps its own shard of main parameters and Adam state
(``get_parameter_state_dp_reshardable``, copied out of the live buffers) in its file, which is
enough because a checkpoint resumes only under the sizes it was saved with.

A checkpoint resumes under the same parallel sizes it was saved with; anything else is refused
with the sizes named (re-sharding is not implemented).
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from omnibal_ext.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(UserError):
    """A --load folder that this run cannot resume from; the message names --load and the file."""


def _rank_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", f"rank_{rank:05d}.pt")


def _sharded_optimizers(optimizer) -> list:
    """The optimizers (the one given, or those it chains) that shard their state over data-parallel ranks."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if hasattr(o, "get_parameter_state_dp_reshardable")]


def _copied(tree):
    """The state with every tensor copied out (a saved view would drag its whole buffer along)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copied(v) for v in tree]
    return tree


def _shard_states(optimizer) -> list:
    return [_copied(o.get_parameter_state_dp_reshardable()) for o in _sharded_optimizers(optimizer)]


@torch.no_grad()  # fp32 main-parameter shards are views of the model's leaf parameters
def _load_shard_states(optimizer, states: list, where: str) -> None:
    sharded = _sharded_optimizers(optimizer)
    if len(states) != len(sharded):
        raise CheckpointError(f"--load {where}: {len(states)} distributed-optimizer shard states saved, "
                         f"this run has {len(sharded)} sharded optimizers")
    for o, state in zip(sharded, states):
        # Without TE/apex, megatron-core's DistributedOptimizer.load_state_dict gives every parameter
        # the same 'step' tensor; torch's Adam then adds 1 to it once per parameter per iteration,
        # which breaks the bias correction after a resume.  One tensor per parameter again:
        for param_state in o.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()
        for key, by_dtype in state.items():
            if isinstance(key, int):  # gradient buffers; every saved element is a parameter, no padding
                for buckets in by_dtype.values():
                    for bucket in buckets:
                        for elem in bucket:
                            elem.setdefault("padding", False)
        o.load_parameter_state_from_dp_reshardable(state)


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
        "optimizer_shards": _shard_states(optimizer),
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
        raise CheckpointError(f"--load {root}: no {TRACKER} there (nothing saved yet?)")
    with open(tracker) as f:
        iteration = int(f.read().strip())
    path = _rank_file(root, iteration, dist.get_rank())
    if not os.path.exists(path):
        raise CheckpointError(f"--load {root}: {path} is missing (saved with another world size?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state.get("parallel", {})
    if saved != parallel:
        raise CheckpointError(f"--load {root}: checkpoint was saved with {saved}, this run is {parallel}")
    for m, sd in zip(model, state["model"]):
        (m.module if hasattr(m, "module") else m).load_state_dict(sd)
    optimizer.load_state_dict(state["optimizer"])
    _load_shard_states(optimizer, state.get("optimizer_shards", []), root)
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
