"""Saving: every rank writes its shards into ``iter_N.tmp``; then the manifest, the rename, the tracker, last."""
from __future__ import annotations

import os
import shutil
import signal
import time

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                               _replace_state_dict_keys_with_sharded_keys,
                                                               mcore_to_pyt_state_dict)
from torch.distributed import checkpoint as dcp

from .files import fsync_dir, hash_files, write_json, write_text
from .layout import MANIFEST, TRACKER, complete_iterations, iteration_dir
from .param_steps import one_step_for_save
from .state import rng_object, rng_state, run_description, sharded_state_dict, to_tensors


def save_checkpoint(plan, iteration: int, consumed_samples: int, model, optimizer, scheduler, train_data) -> None:
    """Save iteration ``iteration`` of the run ``plan`` (a RunPlan) under its --save folder atomically (see the
    module docstring); every rank calls it."""
    ckpt = plan.config.checkpoint
    root = ckpt.save
    tmp = _fresh_folder(root, iteration)
    with one_step_for_save(model, optimizer) as param_steps:  # megatron-core saves one Adam step for all
        sd = sharded_state_dict(model, optimizer, with_optimizer=True, is_loading=False)
        sd.update({"rng": rng_object(rng_state()), "iteration": iteration, "consumed_samples": consumed_samples,
                   "scheduler": scheduler.state_dict(), "data": to_tensors(train_data.state_dict()),
                   "run": run_description(plan), "param_steps": param_steps})
        dist_checkpointing.save(sd, tmp, sharded_strategy=_save_strategy(), validate_access_integrity=True)
    fault_point("save", iteration)
    _publish(root, iteration, ckpt.keep_checkpoints)


def _fresh_folder(root: str, iteration: int) -> str:
    """``iter_N.tmp`` under ``root``, empty (a save killed before under the same iteration left one)."""
    tmp = iteration_dir(root, iteration) + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    return tmp


def _publish(root: str, iteration: int, keep: int | None) -> None:
    """After every rank wrote ``iter_N.tmp``: the manifest, the rename to ``iter_N`` and the tracker, last."""
    rank = dist.get_rank()
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    manifest = hash_files(tmp)
    if rank == 0:
        write_json(os.path.join(tmp, MANIFEST), {"iteration": iteration, "files": manifest})  # fsyncs tmp too
        if os.path.exists(final):  # saved before under the same iteration (a run restarted from earlier)
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        fsync_dir(root)
        write_text(os.path.join(root, TRACKER), str(iteration))
        _remove_old(root, keep)
    dist.barrier()
    if rank == 0:
        print(f"> saved checkpoint of iteration {iteration} to {final}", flush=True)


def save_global_tensors(root: str, tensors: dict, objects: list, common: dict, iteration: int = 0) -> None:
    """Write a weights-only checkpoint of iteration ``iteration`` from a world of one: ``tensors`` {checkpoint
    key: GLOBAL tensor} (the keys and global shapes a stage's ``sharded_state_dict`` declares, saved whole as
    replica 0), ``objects`` the ShardedObjects a model declares besides (its modules' extra state), ``common``
    the common state ("run", "iteration"; no "scheduler": ``load_checkpoint`` then loads weights only, at any
    TP/PP/layout). Same atomic save, manifest and tracker as ``save_checkpoint``."""
    if dist.get_world_size() != 1:
        raise RuntimeError("save_global_tensors: a world of one writes the whole model")
    tmp = _fresh_folder(root, iteration)
    model = {key: ShardedTensor.from_rank_offsets(key, t.contiguous(), replica_id=0) for key, t in tensors.items()}
    model.update({obj.unique_key: obj for obj in objects})  # one per shard (an MoE layer: one per expert)
    sd = {"model": model, **common}
    dist_checkpointing.save(sd, tmp, sharded_strategy=_save_strategy(), validate_access_integrity=True)
    _publish(root, iteration, None)


def _save_strategy():
    return InProcessTorchDistSave("torch_dist", 1)


class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron-core's ``torch_dist`` format, written by this process with PyTorch DCP's FileSystemWriter.

    megatron-core's own writer forks a writer process per rank and save, which writes each tensor apart
    (measured 3x slower than one torch.save of the same state, scripts/bench_checkpoint.py), and on its
    first save spawns a multiprocessing Manager that outlives a SIGKILLed rank. Saves here are synchronous
    anyway; the files (one per rank, fsynced) and the metadata are those megatron-core reads back.
    """

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        dcp.save(mcore_to_pyt_state_dict(by_key, False),
                 storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                          flatten_state_dict=False))


def _remove_old(root: str, keep: int | None) -> None:
    """Delete complete checkpoints older than the newest ``keep`` (None: keep all)."""
    if not keep:
        return
    for iteration in complete_iterations(root)[:-keep]:
        shutil.rmtree(iteration_dir(root, iteration), ignore_errors=True)


def fault_point(where: str, iteration: int) -> None:
    """Test hook: ``OMNIBAL_FAULT=save:N`` (inside the save of iteration N, after the shards are written and
    before the manifest) or ``train:N`` (before iteration N) SIGKILLs rank ``OMNIBAL_FAULT_RANK`` (default 1)
    of the first attempt of a torchrun job; with ``OMNIBAL_FAULT_STALL=S`` that rank sleeps S seconds there
    instead (a rank that never joins the next collective)."""
    fault = os.environ.get("OMNIBAL_FAULT")
    if not fault or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if fault == f"{where}:{iteration}" and dist.get_rank() == int(os.environ.get("OMNIBAL_FAULT_RANK", "1")):
        stall = os.environ.get("OMNIBAL_FAULT_STALL")
        if stall:
            print(f"> fault: rank {dist.get_rank()} stalls {stall} s at {where}:{iteration}", flush=True)
            time.sleep(float(stall))
            return
        os.kill(os.getpid(), signal.SIGKILL)
