"""Saving: every rank writes its shards into ``iter_N.tmp``; then the manifest, the rename, the tracker, last.

A failure on any rank (a full disk, say) stops every rank with one line naming the folder and the iteration
(``SaveError``), after the partial ``iter_N.tmp`` is removed: the previous checkpoint and the tracker are untouched."""
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
from torch.distributed.checkpoint.api import CheckpointException

from omnibal_ext.errors import RunStopped

from .files import fsync_dir, hash_files, write_json, write_text
from .layout import MANIFEST, TRACKER, complete_iterations, iteration_dir
from .lineage import set_aside, to_prune
from . import space
from .param_steps import one_step_for_save
from .state import data_objects, rng_object, rng_state, run_description, sharded_state_dict, to_tensors


class SaveError(RunStopped):
    """A checkpoint that could not be written (a full disk, say); the message names the folder and iteration."""


class _PeerFailed(Exception):
    """Raised on the ranks that wait for a rank whose part of a save failed first."""


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
        sd.update(data_objects(train_data, for_loading=False))  # a per-data-parallel-rank position (Energon's)
        _write(sd, root, tmp, iteration)
    fault_point("save", iteration)
    _publish(root, iteration, ckpt.keep_checkpoints)


def _write(sd: dict, root: str, tmp: str, iteration: int) -> None:
    """megatron-core's save of ``sd`` into ``tmp``; a rank's failure (a full disk, say) stops every rank with one
    line, after rank 0 removed ``tmp``: the previous checkpoint and the tracker are untouched."""
    strategy = _save_strategy()
    error = None
    try:
        dist_checkpointing.save(sd, tmp, sharded_strategy=strategy, validate_access_integrity=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of it (_agree); PyTorch
        error = e  # DCP's CheckpointException (a failed write on any rank, raised on all) is a BaseException
        strategy.meet_after_failure(e)
    _agree(error, root, iteration, cleanup=tmp)


def _agree(error: BaseException | None, root: str, iteration: int, cleanup: str | None = None) -> None:
    """Every rank tells the others whether its part of the save of ``iteration`` failed; on any failure rank 0
    removes ``cleanup`` (rank 0's: the partial folder, None once it is complete) and every rank raises: ``SaveError``
    naming the folder for a failed write (a bug keeps its traceback on its rank; the others name that rank)."""
    kind = None if error is None else "peer" if isinstance(error, _PeerFailed) else space.write_failure(error, root) or "bug"
    # the rank it struck: PyTorch DCP raises a write's failure on every rank, naming the ranks it struck
    origin = min(error.failures) if isinstance(error, CheckpointException) else dist.get_rank()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if kind is None else (kind, origin))
    failures = [f for f in everyone if f is not None]
    if not failures:
        return
    shared = [None]  # rank 0's view, the same in every rank's line: (free bytes or None, the folder removed)
    if dist.get_rank() == 0:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
        shared[0] = (space.free_bytes(root) if os.path.isdir(root) else None, cleanup)
    dist.broadcast_object_list(shared, src=0)
    free, cleanup = shared[0]
    written = [f for f in failures if f[0] not in ("peer", "bug")]
    if kind == "bug" and not written:  # not a failed write: a bug, with its traceback
        raise error
    failures = written or [f for f in failures if f[0] == "bug"] or failures
    tracker = os.path.join(root, TRACKER)
    previous = open(tracker).read().strip() if os.path.exists(tracker) else None
    what, rank = failures[0] if written else ("an error (its traceback is on that rank)", failures[0][1])
    raise SaveError(f"{what}: the checkpoint of iteration {iteration} could not be written to --save {root} (rank "
                    f"{rank}" + ("" if free is None else f"; {space.gib(free)} free there now") + ")"
                    + (f"; its partial folder {cleanup} was removed" if cleanup else "")
                    + (f"; the checkpoint of iteration {previous} (the tracker's) is intact: make room, or give "
                       f"another --save, and resume with --load {root}" if previous else
                       "; no earlier checkpoint is there"))


def _fresh_folder(root: str, iteration: int) -> str:
    """``iter_N.tmp`` under ``root``, empty (a save killed before under the same iteration left one)."""
    tmp = iteration_dir(root, iteration) + ".tmp"
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    _agree(error, root, iteration)
    return tmp


def _publish(root: str, iteration: int, keep: int | None) -> None:
    """After every rank wrote ``iter_N.tmp``: the manifest, the rename to ``iter_N`` and the tracker, last; then
    ``--keep-checkpoints``' pruning (lineage.py)."""
    rank = dist.get_rank()
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    manifest = hash_files(tmp)
    error, cleanup = None, None
    if rank == 0:
        try:
            cleanup = tmp
            write_json(os.path.join(tmp, MANIFEST), {"iteration": iteration, "files": manifest})  # fsyncs tmp too
            if os.path.exists(final):  # saved before under the same iteration (a run restarted from earlier)
                os.replace(final, final + ".old")
            os.replace(tmp, final)
            cleanup = None  # complete from here: a failed tracker leaves the tracker's older one in charge
            shutil.rmtree(final + ".old", ignore_errors=True)
            fsync_dir(root)
            write_text(os.path.join(root, TRACKER), str(iteration))
        except OSError as e:
            error = e
    _agree(error, root, iteration, cleanup)
    if rank == 0:
        for old in to_prune(complete_iterations(root), iteration, keep):
            shutil.rmtree(iteration_dir(root, old), ignore_errors=True)
        print(f"> saved checkpoint of iteration {iteration} to {final}", flush=True)


def prepare_save_folder(root: str, continues_from: int | None, need_bytes: int) -> None:
    """At the start of a run (rank 0, the folder locked): other lineages' checkpoints moved aside
    (``lineage.set_aside``; ``continues_from``: the iteration of the checkpoint of ``root`` the run resumes from,
    None if none), and a warning when fewer than two checkpoints of ``need_bytes`` fit."""
    for line in (set_aside(root, continues_from), space.space_warning(root, need_bytes, space.free_bytes(root))):
        if line:
            print(line, flush=True)


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
    _write({"model": model, **common}, root, tmp, iteration)
    _publish(root, iteration, None)


def _save_strategy():
    return InProcessTorchDistSave("torch_dist", 1)


class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron-core's ``torch_dist`` format, written by this process with PyTorch DCP's FileSystemWriter.

    megatron-core's own writer forks a writer process per rank and save, which writes each tensor apart
    (measured 3x slower than one torch.save of the same state, scripts/bench_checkpoint.py), and on its
    first save spawns a multiprocessing Manager that outlives a SIGKILLed rank. Saves here are synchronous
    anyway; the files (one per rank, fsynced) and the metadata are those megatron-core reads back.


    A failure on one rank reaches every rank (``meet_after_failure``): PyTorch DCP's own collectives report a
    failed shard write to all; rank 0's writes of the common state (``common.pt``, before the shards) and of
    ``metadata.json`` (after) are its alone, and the others wait for it in this strategy's first collective and in
    megatron-core's last barrier respectively.
    """

    stage = "common"  # then "shards" (in this strategy's save), then "written"

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        self.stage = "shards"
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, None)  # where a rank whose common state failed meets the others
        if any(failed):
            raise _PeerFailed(f"rank {next(r for r, f in enumerate(failed) if f)} failed before the shards")
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        dcp.save(mcore_to_pyt_state_dict(by_key, False),
                 storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                          flatten_state_dict=False))
        self.stage = "written"

    def meet_after_failure(self, error: BaseException) -> None:
        """On the rank whose ``dist_checkpointing.save`` raised ``error``: take part in the collective the other
        ranks wait in, so that they get to the agreement after the save (``_agree``)."""
        if self.stage == "common":  # rank 0's common.pt: the others wait in save()'s first collective
            dist.all_gather_object([None] * dist.get_world_size(), repr(error))
        elif self.stage == "written":  # rank 0's metadata.json: the others wait in megatron-core's barrier
            dist.barrier()


def fault_point(where: str, iteration: int) -> None:
    """Test hook: ``OMNIBAL_FAULT=save:N`` (inside the save of iteration N, after the shards are written and
    before the manifest) or ``train:N`` (before iteration N) SIGKILLs rank ``OMNIBAL_FAULT_RANK`` (default 1)
    of the first attempt of a torchrun job; a comma-separated list gives attempt k the k-th fault
    (``save:4,train:5``: the first attempt dies inside the save of 4, the restarted one before iteration 5). With
    ``OMNIBAL_FAULT_STALL=S`` that rank sleeps S seconds there instead (a rank that never joins the next
    collective)."""
    faults = os.environ.get("OMNIBAL_FAULT", "").split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(faults):
        return
    if faults[attempt] == f"{where}:{iteration}" and dist.get_rank() == int(os.environ.get("OMNIBAL_FAULT_RANK", "1")):
        stall = os.environ.get("OMNIBAL_FAULT_STALL")
        if stall:
            print(f"> fault: rank {dist.get_rank()} stalls {stall} s at {where}:{iteration}", flush=True)
            time.sleep(float(stall))
            return
        os.kill(os.getpid(), signal.SIGKILL)
