"""Checkpoints: megatron-core distributed checkpoints (``torch_dist``), resharded at load.

Layout (Megatron's)::

    SAVE/latest_checkpointed_iteration.txt   iteration of the newest complete checkpoint
    SAVE/iter_0000006/                       one megatron-core distributed checkpoint:
        .metadata, __<rank>_<n>.distcp       PyTorch DCP: every rank writes the shards it owns
        common.pt, metadata.json             the common state (rank 0)
        omnibal_manifest.json                size and XXH3-64 checksum of every file above, written last

What is in it:
- the model under the global unit names (``vit.layer.7.…``, ``llm.layer.31.…``; see
  megatron/vlm/sharding.py), each tensor with its tensor-parallel split declared, ViT heads unpadded;
- the optimizer state in model space: Adam's moments per parameter, keyed like the parameter (for the
  distributed optimizer megatron-core's ``fully_reshardable`` form, which also holds the fp32 main
  parameters); so it loads under any TP/PP/DP, layout, recompute plan and optimizer kind;
- per-rank RNG states (restored when TP, PP and DP are unchanged; re-seeded from --seed and the iteration
  otherwise);
- common state: iteration, consumed samples, LR scheduler, the data position (a DP change continues the
  epoch, see omnibal_ext.data.sampler) and a description of the run (model sizes, parallel sizes, layout).

Saving is atomic: everything goes into ``iter_N.tmp``; once every rank has written its shards, the
manifest is written, the folder renamed to ``iter_N`` and the tracker file written under a temporary name
and renamed, last. A kill at any moment leaves the previous complete checkpoint loadable; a leftover
``.tmp`` folder is ignored and removed by the next save.

Loading checks before any weight is touched: the manifest (every file present, of its size and checksum),
the model description and every tensor's global shape. A problem stops the run with one paragraph that
names the file or tensor and the iteration, and the newest older complete checkpoint (``--ckpt-step``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import random
import re
import shutil
import signal

import numpy as np
import torch
import xxhash
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedBase, ShardedObject,
                                                      ShardedTensor, ShardedTensorFactory, apply_factories)
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from omnibal_ext.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "omnibal_manifest.json"
FORMAT = "omnibal-torch_dist-1"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
# The optimizer state in model space, whatever the optimizer kind (megatron-core's fully reshardable form);
# the distributed optimizer's shards are gathered to its data-parallel rank 0 in host memory (over gloo),
# never to every rank nor on the GPU.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                      "distrib_optim_fully_reshardable_mem_efficient": True}


class CheckpointError(UserError):
    """A --load folder that this run cannot resume from; the message names the file or tensor."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint found under --load."""

    root: str
    iteration: int

    @property
    def path(self) -> str:
        return iteration_dir(self.root, self.iteration)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _unwrap(module):
    return module.module if hasattr(module, "module") else module


# ---------------------------------------------------------------------------------------------
# What is saved
# ---------------------------------------------------------------------------------------------
def run_description(args) -> dict:
    """The run a checkpoint comes from: model sizes and the parallel configuration."""
    return {"format": FORMAT, "model": args.model_spec.to_dict(), "tp": args.tensor_model_parallel_size,
            "pp": args.pipeline_model_parallel_size, "dp": args.data_parallel_size,
            "layout": getattr(args, "layout_flag", None), "distributed_optimizer": bool(args.use_distributed_optimizer),
            "bf16": bool(args.bf16), "seed": args.seed, "tokenizer": getattr(args, "tokenizer_model", None),
            "hf": getattr(args, "hf_meta", None)}  # the HF checkpoint the model came from (omnibal hf export)


def _world(run: dict) -> tuple:
    return run["tp"], run["pp"], run["dp"]


def _map_leaves(tree, leaf):
    """``tree`` (nested dicts, lists, tuples) with every other value replaced by ``leaf(value)``."""
    if isinstance(tree, dict):
        return {k: _map_leaves(v, leaf) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(v, leaf) for v in tree)
    return leaf(tree)


def _tensor_leaf(value):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return value.item() if isinstance(value, np.generic) else value


def to_tensors(tree):
    """``tree`` with numpy arrays as torch tensors and numpy scalars as Python ones: checkpoints are read
    with torch.load(weights_only=True), which takes tensors and plain Python containers only."""
    return _map_leaves(tree, _tensor_leaf)


def to_arrays(tree):
    """The inverse of :func:`to_tensors` for what it changed (tensors back to numpy arrays)."""
    return _map_leaves(tree, lambda v: v.numpy() if isinstance(v, torch.Tensor) else v)


def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": to_tensors(np.random.get_state()), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(to_arrays(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_object(state) -> ShardedObject:
    """This rank's RNG states, one object per (PP, TP, DP) rank."""
    ps = parallel_state
    return ShardedObject("rng_state", state,
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
                          ps.get_data_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                          ps.get_data_parallel_rank()), replica_id=0)


def _model_sharded_state_dict(model) -> dict:
    return _unwrap(model[0]).sharded_state_dict()


def _sharded_state_dict(model, optimizer, with_optimizer: bool, is_loading: bool) -> dict:
    model_sd = _model_sharded_state_dict(model)
    sd = {"model": model_sd}
    if with_optimizer:
        sd["optimizer"] = optimizer.sharded_state_dict(_model_sharded_state_dict(model), is_loading=is_loading,
                                                       metadata=OPTIMIZER_METADATA)
    return sd


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------
def save_checkpoint(args, iteration: int, consumed_samples: int, model, optimizer, scheduler, train_data) -> None:
    """Save iteration ``iteration`` under ``args.save`` atomically (see the module docstring); every rank calls it."""
    root = args.save
    tmp = _fresh_folder(root, iteration)
    sd = _sharded_state_dict(model, optimizer, with_optimizer=True, is_loading=False)
    sd.update({"rng": _rng_object(rng_state()), "iteration": iteration, "consumed_samples": consumed_samples,
               "scheduler": scheduler.state_dict(), "data": to_tensors(train_data.state_dict()), "run": run_description(args)})
    dist_checkpointing.save(sd, tmp, sharded_strategy=_save_strategy(), validate_access_integrity=True)
    fault_point("save", iteration)
    _publish(root, iteration, args.keep_checkpoints)


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
    manifest = _manifest(tmp)
    if rank == 0:
        _write_json(os.path.join(tmp, MANIFEST), {"iteration": iteration, "files": manifest})  # fsyncs tmp too
        if os.path.exists(final):  # saved before under the same iteration (a run restarted from earlier)
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        _fsync_dir(root)
        _write_text(os.path.join(root, TRACKER), str(iteration))
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
    model.update({obj.key: obj for obj in objects})
    sd = {"model": model, **common}
    dist_checkpointing.save(sd, tmp, sharded_strategy=_save_strategy(), validate_access_integrity=True)
    _publish(root, iteration, None)


def read_global_tensors(path: str, keys) -> dict:
    """The global tensors ``keys`` of the checkpoint folder ``path`` (an ``iter_N``), however it was sharded
    (any TP/PP/DP, layout): read in this process with PyTorch DCP, only those tensors."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    reader = FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    missing = sorted(k for k in keys if k not in meta)
    if missing:
        raise CheckpointError(f"{path}: model tensor(s) missing: {', '.join(missing[:8])}")
    out = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    dcp_load(out, storage_reader=reader, no_dist=True)
    return out


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
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
        from torch.distributed import checkpoint as dcp

        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        dcp.save(mcore_to_pyt_state_dict(by_key, False),
                 storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                          flatten_state_dict=False))


def _manifest(folder: str) -> dict:
    """{file: [bytes, XXH3-64]} of every file under ``folder``, each rank hashing (and fsyncing: megatron-core's
    common files are not) its share of the files."""
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    mine = {}
    for name in files[dist.get_rank()::dist.get_world_size()]:
        path = os.path.join(folder, name)
        _fsync_file(path)
        mine[name] = [os.path.getsize(path), _digest(path)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {f: v for part in everyone for f, v in sorted(part.items())}


def _digest(path: str) -> int:
    """XXH3-64 of a file's bytes (read through a memory map: ~25 GB/s from the page cache, 10x zlib's CRC32
    read in chunks, measured)."""
    if os.path.getsize(path) == 0:
        return xxhash.xxh3_64_intdigest(b"")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return xxhash.xxh3_64_intdigest(data)


def _write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file, fsync, rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _write_json(path: str, obj) -> None:
    _write_text(path, json.dumps(obj, indent=1))


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_old(root: str, keep: int | None) -> None:
    """Delete complete checkpoints older than the newest ``keep`` (None: keep all)."""
    if not keep:
        return
    for iteration in _iterations(root)[:-keep]:
        shutil.rmtree(iteration_dir(root, iteration), ignore_errors=True)


def fault_point(where: str, iteration: int) -> None:
    """Test hook: ``OMNIBAL_FAULT=save:N`` (inside the save of iteration N, after the shards are written and
    before the manifest) or ``train:N`` (before iteration N) SIGKILLs rank ``OMNIBAL_FAULT_RANK`` (default 1)
    of the first attempt of a torchrun job."""
    fault = os.environ.get("OMNIBAL_FAULT")
    if not fault or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if fault == f"{where}:{iteration}" and dist.get_rank() == int(os.environ.get("OMNIBAL_FAULT_RANK", "1")):
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Finding and checking
# ---------------------------------------------------------------------------------------------
def _iterations(root: str) -> list[int]:
    """Iterations of the complete (renamed) checkpoint folders under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := _ITER_DIR.match(name)))


def find_checkpoint(root: str, step: int | None = None) -> Checkpoint | None:
    """The checkpoint to resume from (the tracker's, or ``step``), checked; None when ``root`` holds none.

    Every rank calls it (the checksums are split over the ranks). Raises CheckpointError naming the
    problem, the iteration and the newest older complete checkpoint.
    """
    iterations = _iterations(root)
    tracker = os.path.join(root, TRACKER)
    if step is None:
        if not os.path.exists(tracker):
            if not iterations:
                return None
            step = iterations[-1]  # killed between the folder's rename and the tracker's
        else:
            text = open(tracker).read().strip()
            if not text.isdigit():
                raise CheckpointError(f"--load {root}: {tracker} holds {text!r}, not an iteration number"
                                      f"{_older_hint(root, None)}")
            step = int(text)
    ckpt = Checkpoint(root, step)
    problems = _check_files(ckpt)
    if problems:
        raise CheckpointError(f"--load {root}: the checkpoint of iteration {step} is incomplete or corrupt: "
                              f"{problems[0]}" + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1
                                                  else "") + _older_hint(root, step))
    return ckpt


def _check_files(ckpt: Checkpoint) -> list[str]:
    """Problems with the checkpoint's files (every rank checks its share of the checksums; all ranks agree)."""
    folder = ckpt.path
    if not os.path.isdir(folder):
        problems = [f"{folder} does not exist"]
    else:
        problems = _sizes_problems(folder)
    if not problems:
        files = json.load(open(os.path.join(folder, MANIFEST)))["files"]
        for name in sorted(files)[dist.get_rank()::dist.get_world_size()]:
            if _digest(os.path.join(folder, name)) != files[name][1]:
                problems.append(f"{os.path.join(folder, name)} is corrupt (its XXH3 checksum differs from the one saved)")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return sorted({p for part in everyone for p in part})


def _sizes_problems(folder: str) -> list[str]:
    """Missing manifest, missing files and files of the wrong size (cheap: no data read)."""
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.exists(manifest):
        return [f"{manifest} is missing (the save did not finish)"]
    try:
        files = json.load(open(manifest))["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return [f"{manifest} is unreadable ({e})"]
    problems = []
    for name, (size, _) in sorted(files.items()):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{path} has {os.path.getsize(path)} bytes, {size} were saved (truncated?)")
    return problems


def _older_hint(root: str, iteration: int | None) -> str:
    older = [i for i in _iterations(root) if iteration is None or i < iteration]
    for i in reversed(older):
        if not _sizes_problems(iteration_dir(root, i)):
            return f". The newest older complete checkpoint is iteration {i}: resume from it with --ckpt-step {i}"
    return ". No older complete checkpoint is there"


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def load_checkpoint(ckpt: Checkpoint, args, model, optimizer, scheduler) -> dict:
    """Load ``ckpt`` into this run's model, optimizer and scheduler, whatever TP/PP/DP, layout, recompute plan
    and optimizer kind it was saved with; returns its common state (iteration, consumed samples, data)."""
    common = dist_checkpointing.load_common_state_dict(ckpt.path)
    saved_run = common.get("run") or {}
    _check_model(ckpt, saved_run, args)
    _check_tensors(ckpt, model)
    with_optimizer = "scheduler" in common  # an imported model (iteration 0) holds weights only
    if with_optimizer:
        _init_optimizer_state(optimizer)
    request = _sharded_state_dict(model, optimizer, with_optimizer, is_loading=True)
    same_world = saved_run and _world(saved_run) == (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                                     args.data_parallel_size)
    if with_optimizer:
        _adapt_optimizer_request(request["optimizer"], saved_run, args)
    if same_world:
        request["rng"] = _rng_object(None)
    template = _skeleton(request.get("optimizer"))  # the load rewrites the request's factories in place
    keys = {path: sh.key for path, sh in request["model"].items()}
    loaded = dist_checkpointing.load(request, ckpt.path)
    _unwrap(model[0]).load_state_dict(loaded["model"])
    if with_optimizer:
        weights = {keys[path]: tensor for path, tensor in loaded["model"].items()}
        _load_optimizer(optimizer, loaded["optimizer"], template, weights, saved_run, args)
        scheduler.load_state_dict(common["scheduler"])
    else:
        optimizer.reload_model_params()
    if same_world:
        set_rng_state(loaded["rng"])
    else:
        from .initialize import set_seeds

        set_seeds(args.seed + int(common.get("iteration", 0)))
    if dist.get_rank() == 0:
        print(f"> loaded checkpoint of iteration {ckpt.iteration} from {ckpt.path}"
              + ("" if same_world or not saved_run else
                 f" (saved at TP={saved_run['tp']} PP={saved_run['pp']} DP={saved_run['dp']}, resharded; RNG re-seeded)"),
              flush=True)
    return common


def _check_model(ckpt: Checkpoint, saved_run: dict, args) -> None:
    """The checkpoint's model sizes must be this run's (a clear message rather than a tensor shape)."""
    from omnibal_ext.model.units import ModelSpec

    if saved_run.get("model") is None:
        return
    saved = ModelSpec.from_dict(saved_run["model"]).to_dict()  # fields added since: their defaults
    mine = args.model_spec.to_dict()
    diffs = [f"{k}: {v} saved, {mine_v} now" for k, v, mine_v in _flat_diff(saved, mine)]
    if diffs:
        raise CheckpointError(f"--load {ckpt.root}: the checkpoint of iteration {ckpt.iteration} holds another "
                              f"model shape ({'; '.join(diffs)}); give the model flags it was saved with")


def _flat_diff(a: dict, b: dict, prefix: str = ""):
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            yield from _flat_diff(va, vb, f"{prefix}{k}.")
        elif va != vb and k not in ("name", "init_method_std"):  # neither changes the weights a checkpoint holds
            yield f"{prefix}{k}", va, vb


def _check_tensors(ckpt: Checkpoint, model) -> None:
    """Every model tensor this rank needs is in the checkpoint with this global shape."""
    saved = dist_checkpointing.load_tensors_metadata(ckpt.path)
    sd = _model_sharded_state_dict(model)
    apply_factories(sd)
    problems = []
    for sh in nested_values(sd):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in saved:
            problems.append(f"tensor {sh.key} is not in it")
        elif tuple(saved[sh.key].global_shape) != tuple(sh.global_shape):
            problems.append(f"tensor {sh.key} has shape {tuple(saved[sh.key].global_shape)} there, "
                            f"{tuple(sh.global_shape)} in this model")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    problems = sorted({p for part in everyone for p in part})
    if problems:
        raise CheckpointError(f"--load {ckpt.root}: the checkpoint of iteration {ckpt.iteration} does not fit this "
                              f"model: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def _init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its Adam state (zeros, step 0) before a load request is built from it.

    megatron-core's DistributedOptimizer reads every parameter's 'step' to describe itself (torch's Adam,
    without TE/apex), and a fresh one has none; the non-distributed optimizers initialise themselves.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "get_parameter_state_dp_reshardable") or opt.optimizer.state:
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        for param_state in opt.optimizer.state.values():
            param_state["step"] = torch.tensor(0.0)


# The fp32 main parameters under each optimizer kind: the distributed optimizer's fully reshardable form
# ("param"), the mixed-precision optimizer ("fp32_param"), and none for fp32 training (the weights are).
_MAIN_PARAM = {"distributed": "optimizer.state.param.", "mixed": "optimizer.state.fp32_param."}


def _optimizer_kind(run: dict) -> str:
    return "distributed" if run.get("distributed_optimizer") else "mixed" if run.get("bf16") else "fp32"


def _adapt_optimizer_request(request: dict, saved_run: dict, args) -> None:
    """Point the requested fp32 main parameters at what the saved optimizer kind stored them under
    (the model's own weights when it trained in fp32). Adam's moments are keyed alike in every kind."""
    saved, mine = _optimizer_kind(saved_run), _optimizer_kind(run_description(args))
    if saved == mine or mine not in _MAIN_PARAM:
        return
    old = _MAIN_PARAM[mine]

    def point(sh):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or not sh.key.startswith(old):
            return sh
        if saved in _MAIN_PARAM:
            sh.key = _MAIN_PARAM[saved] + sh.key[len(old):]
            return sh
        return _FromModel(sh.key[len(old):])  # fp32 training: the main parameters are the weights

    dict_list_map_inplace(point, request)


@dataclasses.dataclass(frozen=True)
class _FromModel:
    """In an optimizer load request: this tensor is the model's weight under checkpoint key ``key``."""

    key: str


def _load_optimizer(optimizer, state: dict, template: dict, model_weights: dict, saved_run: dict, args) -> None:
    """Load the optimizer state; ``template`` is the skeleton of the request it was loaded with (this
    optimizer's own structure). Saved by another optimizer kind, the loaded common part (param groups,
    step) has that kind's structure: the state is then rebuilt on the template with the loaded tensors
    and step (``model_weights``: the loaded weights by checkpoint key, for main parameters that were not
    saved apart)."""
    if _optimizer_kind(saved_run) != _optimizer_kind(run_description(args)):
        state = _rebuilt(template, state, torch.tensor(_saved_step(state)), model_weights)
    with contextlib.ExitStack() as stack:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if hasattr(opt, "get_parameter_state_dp_reshardable"):
                stack.enter_context(_step_set_apart(opt))
        optimizer.load_state_dict(state)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        # Without TE/apex, megatron-core's DistributedOptimizer gives every parameter the same 'step'
        # tensor after a load; torch's Adam then adds 1 to it once per parameter per iteration, which
        # breaks the bias correction. One tensor per parameter again:
        for param_state in opt.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()


@contextlib.contextmanager
def _step_set_apart(opt):
    """While a DistributedOptimizer loads its fully reshardable state: megatron-core 0.16.1 copies every
    entry of a parameter's Adam state from the loaded tensors, 'step' included, but that form keeps the
    step in the param groups (set by load_state_dict itself), so without TE/apex the copy fails on
    'step'. The copy is made with 'step' set apart, then put back. Scoped to this optimizer object."""
    copy_states = opt._set_main_param_and_optimizer_states

    def copy_without_step(model_param, tensors):
        group, order = opt.model_param_group_index_map[model_param]
        param_state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
        step = param_state.pop("step", None)
        try:
            copy_states(model_param, tensors)
        finally:
            if step is not None:
                param_state["step"] = step

    opt._set_main_param_and_optimizer_states = copy_without_step
    try:
        yield
    finally:
        del opt._set_main_param_and_optimizer_states


def _saved_step(state) -> float:
    """Adam's step count in a loaded optimizer state of any kind (a per-parameter step shared by all)."""
    if isinstance(state, dict):
        if "common_step" in state:
            return float(state["common_step"])
        if "lr" in state and "step" in state:  # a param group (distributed optimizer)
            return float(state["step"])
        values = state.values()
    elif isinstance(state, list):
        values = state
    else:
        return None
    for v in values:
        if (step := _saved_step(v)) is not None:
            return step
    return None


_LOADED = object()  # in a skeleton: a tensor the load request asked for


def _skeleton(tree):
    """A load request's structure with its sharded tensors and factories replaced by ``_LOADED``."""
    return _map_leaves(tree, lambda v: _LOADED if isinstance(v, ShardedBase) else v)


def _rebuilt(template, loaded, step: torch.Tensor, model_weights: dict):
    """``template``'s structure (a skeleton): loaded tensors where it requested them, this optimizer's own
    values elsewhere (param groups), Adam's step set to ``step``."""
    if template is _LOADED:
        return loaded
    if isinstance(template, _FromModel):
        return model_weights[template.key]
    if isinstance(template, LocalNonpersistentObject):
        return template.unwrap()
    if isinstance(template, list):
        return [_rebuilt(t, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None, step, model_weights)
                for i, t in enumerate(template)]
    if not isinstance(template, dict):
        return template
    out = {k: _rebuilt(t, loaded.get(k) if isinstance(loaded, dict) else None, step, model_weights)
           for k, t in template.items()}
    if "lr" in out and "step" in out:  # a distributed optimizer's param group
        out["step"] = float(step)
    if "state" in out and isinstance(out["state"], dict) and "param_groups" in out:  # a torch optimizer's state
        out["state"]["common_step"] = step
    return out
