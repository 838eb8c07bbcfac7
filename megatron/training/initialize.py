"""Process groups, device choice and seeds."""
from __future__ import annotations

import contextlib
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import num_microbatches_calculator, parallel_state, rerun_state_machine
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import moe_utils

from megatron.vlm.parallel.context_parallel import forget_own_groups

from . import cpu_compat
from .flags import ArgumentError


def choose_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is visible to this process")
    return torch.device(requested)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # --distributed-timeout-minutes' default


def initialize_distributed(device: torch.device, tp: int, pp: int, cp: int = 1, vpp: int = 1, ep: int = 1,
                           etp: int | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
    """Start torch.distributed (gloo on CPU, NCCL on GPU) and megatron's model-parallel groups.

    ``timeout``: how long any collective or p2p transfer of those groups (and the rendezvous) waits for the
    other ranks before it raises; groups made later take it from ``ParallelConfig.timeout``.

    A plain ``python pretrain_vlm.py`` (no torchrun: no MASTER_PORT, WORLD_SIZE unset or 1) runs as a world of
    one over an in-memory store, so it binds no port (one picked free can be taken by another process before it
    is bound).  On CPU the caller has entered ``cpu_compat.patched()`` for the whole run (teardown included).

    ``vpp`` > 1: model chunks per pipeline rank (megatron's virtual pipeline size, which selects the interleaved
    schedule).  ``ep`` / ``etp``: the MoE experts' expert-parallel and expert-tensor-parallel sizes (megatron-core's
    expert grid; ETP None: TP).
    """
    if device.type == "cpu":
        if not cpu_compat.active():
            raise RuntimeError("initialize_distributed on CPU outside cpu_compat.patched(): enter it around "
                               "the whole run (pretrain_vlm.cli and omnibal profile do)")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        alone = os.environ.get("WORLD_SIZE", "1") == "1" and "MASTER_PORT" not in os.environ
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        store = dist.HashStore() if alone else _restart_store(timeout)
        where = {} if store is None else dict(store=store, rank=int(os.environ["RANK"]),
                                              world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend="gloo" if device.type == "cpu" else "nccl",
                                timeout=timeout, **where)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            distributed_timeout_minutes=timeout.total_seconds() / 60)


def _restart_store(timeout: datetime.timedelta):
    """Under torchrun's restarts (--max-restarts): the agent's store, under a prefix of this attempt.

    The agent keeps its store across attempts, and process groups created after a restart use the same
    store keys as before (group names are counters), so a rank could read the address a peer published
    in the killed attempt and fail to connect to it. None (torch's env:// rendezvous) otherwise.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"omnibal/attempt_{attempt}/", store)


def set_seeds(seed: int) -> None:
    """Same seed on every rank: data order and weights do not depend on the parallel layout."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def reset_global_state() -> None:
    """Undo what a run left in megatron-core's process-wide state, keeping the world's process group: the
    model-parallel groups (every group but the world's is destroyed, so none leaks into the next run), the
    model-parallel RNG tracker, the rerun state machine, the micro-batch calculator, the MoE auxiliary-loss
    tracker (its per-layer buffers are sized by the run's layers) and the caches that hold a run's modules or groups
    (megatron-core's rotary tables, the CP split's one-rank groups).  After it, ``main`` can run again in the same
    processes (a test worker pool; ``initialize_distributed`` keeps an initialised world); the groups' gloo threads
    end when the run's objects holding them are collected (not after a MoE run of megatron-core 0.16.1, whose MoE
    layers stay alive with the groups they hold: docs/testing.md)."""
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_global_memory_buffer()
    # megatron-core 0.16.1's destroy_model_parallel leaves these two set: the groups (and their gloo threads) they
    # hold would outlive the run
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
    RotaryEmbedding.forward.cache_clear()  # megatron-core caches its tables with the module (and the module's CP group)
    forget_own_groups()
    if dist.is_initialized():
        world = dist.group.WORLD
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not world:
                dist.destroy_process_group(group)
    get_cuda_rng_tracker().reset()
    rerun_state_machine.destroy_rerun_state_machine()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()


_world_held = 0  # how many hold_world() contexts are open


@contextlib.contextmanager
def hold_world():
    """Inside: :func:`destroy` resets the global state but keeps the world's process group, for whoever started
    that group to run several entry points (``pretrain_vlm.cli``, ``scripts/hf_logits.py``'s ``main``, ``omnibal``
    commands) in the same processes one after the other (a test worker pool)."""
    global _world_held
    _world_held += 1
    try:
        yield
    finally:
        _world_held -= 1


def destroy() -> None:
    """The end of a run: :func:`reset_global_state`, then the world's process group (kept inside ``hold_world``)."""
    reset_global_state()
    if dist.is_initialized() and not _world_held:
        dist.destroy_process_group()
