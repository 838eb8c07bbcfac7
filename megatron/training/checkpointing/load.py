"""Finding, checking and loading: files first, then the model description and every tensor's shape, then the
load, resharded to this run's TP/PP/DP, layout and optimizer kind."""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

from omnibal_ext.model.units import spec_from_dict

from megatron.vlm.layers.lora import is_adapter

from .. import lr_schedule
from ..initialize import set_seeds
from .files import check_files, sizes_problems
from .layout import TRACKER, Checkpoint, CheckpointError, complete_iterations, iteration_dir
from .optimizer import (adapt_optimizer_request, fresh_optimizer_entries, init_optimizer_state, keep_list_positions,
                        load_optimizer, skeleton)
from .param_steps import per_parameter_steps, set_steps
from .state import (data_objects, load_model_state, model_sharded_state_dict, rng_object, set_rng_state,
                    sharded_state_dict, world_of)


def find_checkpoint(root: str, step: int | None = None) -> Checkpoint | None:
    """The checkpoint to resume from (the tracker's, or ``step``), checked; None when ``root`` holds none.

    Every rank calls it (the checksums are split over the ranks). Raises CheckpointError naming the
    problem, the iteration and the newest older complete checkpoint.
    """
    iterations = complete_iterations(root)
    tracker = os.path.join(root, TRACKER)
    if step is None:
        if not os.path.exists(tracker):
            if not iterations:
                return None
            step = iterations[-1]  # killed between the folder's rename and the tracker's
        else:
            with open(tracker) as f:
                text = f.read().strip()
            if not text.isdigit():
                raise CheckpointError(f"--load {root}: {tracker} holds {text!r}, not an iteration number"
                                      f"{_older_hint(root, None)}")
            step = int(text)
    ckpt = Checkpoint(root, step)
    problems = check_files(ckpt)
    if problems:
        raise CheckpointError(f"--load {root}: the checkpoint of iteration {step} is incomplete or corrupt: "
                              f"{problems[0]}" + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1
                                                  else "") + _older_hint(root, step))
    return ckpt


def _older_hint(root: str, iteration: int | None) -> str:
    older = [i for i in complete_iterations(root) if iteration is None or i < iteration]
    for i in reversed(older):
        if not sizes_problems(iteration_dir(root, i)):
            return f". The newest older complete checkpoint is iteration {i}: resume from it with --ckpt-step {i}"
    return ". No older complete checkpoint is there"


def load_checkpoint(ckpt: Checkpoint, plan, model, optimizer, scheduler, train_data=None) -> dict:
    """Load ``ckpt`` into the model, optimizer and scheduler of the run ``plan`` (a RunPlan), whatever TP/PP/DP,
    layout, recompute and optimizer kind it was saved with; returns its common state (iteration, consumed samples,
    data).  ``train_data``: its per-data-parallel-rank position is loaded too when it keeps one (an Energon
    stream's; ``state.data_objects``; the same data-parallel size only)."""
    parallel = plan.config.parallel
    common = dist_checkpointing.load_common_state_dict(ckpt.path)
    saved_run = common.get("run") or {}
    _check_model(ckpt, saved_run, plan.model_spec)
    saved_keys = _check_tensors(ckpt, model)
    with_optimizer = "scheduler" in common  # an imported model (iteration 0) holds weights only
    where = f"--load {ckpt.root} (iteration {ckpt.iteration})"
    if with_optimizer:
        rule = lr_schedule.rule_of(scheduler)
        schedule_changes = lr_schedule.schedule_differences(common["scheduler"], scheduler)
        if schedule_changes and rule is lr_schedule.ResumeRule.CHECK:  # before any tensor is read
            raise CheckpointError(lr_schedule.refusal(where, schedule_changes))
        run_groups = lr_schedule.group_settings(optimizer)
        init_optimizer_state(optimizer)
    request = sharded_state_dict(model, optimizer, with_optimizer, is_loading=True)
    same_world = saved_run and world_of(saved_run) == (parallel.tensor_model_parallel_size,
                                                     parallel.pipeline_model_parallel_size,
                                                     parallel.data_parallel_size, parallel.context_parallel_size)
    fresh = []
    if with_optimizer:
        adapt_optimizer_request(request["optimizer"], saved_run, plan)
        # parameters that train now but were frozen when saved: fresh state (other freeze flags on resume)
        fresh = fresh_optimizer_entries(request["optimizer"], saved_keys)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted({_param_of(k) for k in fresh}))
    fresh_params = sorted({k for part in everyone for k in part})
    if same_world:
        request["rng"] = rng_object(None)
    data_request = _data_request(common, saved_run, plan, train_data) if with_optimizer else {}
    request.update(data_request)
    template = skeleton(request.get("optimizer"))  # the load rewrites the request's factories in place
    if fresh:
        request["optimizer"] = keep_list_positions(request["optimizer"])
    keys = {path: sh.key for path, sh in request["model"].items()}
    fresh_adapters = {path: request["model"].pop(path).data for path in list(request["model"])
                      if is_adapter(keys[path]) and keys[path] not in saved_keys}
    try:
        loaded = dist_checkpointing.load(request, ckpt.path)
    except ValueError as e:  # megatron-core's merge of the saved parameter groups with this run's
        if "param_groups" not in str(e):
            raise
        raise CheckpointError(_other_groups(where, e)) from None
    if data_request:
        train_data.load_sharded_state({k: loaded[k] for k in data_request})
    loaded["model"].update(fresh_adapters)  # LoRA adapters the checkpoint lacks keep their fresh values
    load_model_state(model, loaded["model"])
    if with_optimizer:
        weights = {keys[path]: tensor for path, tensor in loaded["model"].items()}
        try:
            load_optimizer(optimizer, loaded["optimizer"], template, weights, saved_run, plan, rebuild=bool(fresh))
        except ValueError as e:  # megatron-core's and torch's refusals of other parameter groups
            if "parameter group" not in str(e):
                raise
            raise CheckpointError(_other_groups(where, e)) from None
        # megatron-core loaded one step for all: each parameter's own (param_steps.py), 0 for the fresh ones
        set_steps(model, optimizer, {**common.get("param_steps", {}), **{key: 0 for key in fresh_params}})
        _resume_schedule(where, rule, schedule_changes, run_groups, optimizer, scheduler, common["scheduler"])
    else:
        optimizer.reload_model_params()
    if same_world:
        set_rng_state(loaded["rng"])
    else:
        set_seeds(plan.config.optim.seed + int(common.get("iteration", 0)))
    if dist.get_rank() == 0:
        print(f"> loaded checkpoint of iteration {ckpt.iteration} from {ckpt.path}"
              + ("" if same_world or not saved_run else
                 f" (saved at TP={saved_run['tp']} PP={saved_run['pp']} DP={saved_run['dp']}, resharded; RNG re-seeded)"),
              flush=True)
    if fresh_adapters and dist.get_rank() == 0:
        print(f"> the checkpoint holds no LoRA adapters for this run's {len(fresh_adapters)} adapter tensor(s) on this "
              "rank: they start fresh (B = 0)", flush=True)
    if fresh_params and dist.get_rank() == 0:
        shown = ", ".join(fresh_params[:6]) + (f", ... ({len(fresh_params)} in all)" if len(fresh_params) > 6 else "")
        fresh_state = ("Adam moments 0, step 0" if per_parameter_steps() else
                       "Adam moments 0; the step count is the run's: the fused Adam keeps one per parameter group")
        print(f"> the checkpoint holds no optimizer state for {len(fresh_params)} parameter(s) this run trains "
              f"(frozen when it was saved): they start with fresh optimizer state ({fresh_state}): {shown}",
              flush=True)
    return common


def load_weights(ckpt: Checkpoint, plan, model) -> dict:
    """Load only the model weights of ``ckpt`` into this run's model chunks (generation: no optimizer, no data),
    whatever TP/PP/DP and layout it was saved with, after the same checks as ``load_checkpoint``; returns its common
    state."""
    common = dist_checkpointing.load_common_state_dict(ckpt.path)
    _check_model(ckpt, common.get("run") or {}, plan.model_spec)
    _check_tensors(ckpt, model)
    request = model_sharded_state_dict(model)
    loaded = dist_checkpointing.load({"model": request}, ckpt.path)
    load_model_state(model, loaded["model"])
    if dist.get_rank() == 0:
        print(f"> loaded the weights of iteration {ckpt.iteration} from {ckpt.path}", flush=True)
    return common


def _other_groups(where: str, error: ValueError) -> str:
    return (f"{where}: the checkpoint's optimizer holds other parameter groups than this run's ({str(error).splitlines()[0]}): "
            "--vision-lr and --projector-lr make groups of their own; give them (or not) as the run that saved it did")


def _resume_schedule(where: str, rule, schedule_changes: list[str], run_groups: list, optimizer, scheduler,
                     saved: dict) -> None:
    """The scheduler's state loaded under ``rule`` (megatron/training/lr_schedule.py) after the optimizer's, whose
    parameter groups came back with the checkpoint's peak and minimum LR and Adam betas: those differing from this
    run's ``run_groups`` on any rank are refused under CHECK, replaced by this run's under OVERRIDE, kept under
    CHECKPOINT."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, lr_schedule.group_differences(run_groups, optimizer))
    group_changes = sorted({d for part in everyone for d in part})
    if group_changes and rule is lr_schedule.ResumeRule.CHECK:
        raise CheckpointError(lr_schedule.refusal(where, group_changes))
    if rule is not lr_schedule.ResumeRule.CHECKPOINT:
        lr_schedule.restore_group_settings(optimizer, run_groups)
    scheduler.load_state_dict(saved)
    line = lr_schedule.note(rule, schedule_changes + group_changes)
    if line and dist.get_rank() == 0:
        print(line, flush=True)


def _data_request(common: dict, saved_run: dict, plan, train_data) -> dict:
    """The per-data-parallel-rank data position to load (``state.data_objects``), refused by name when the
    checkpoint's data-parallel size differs (Energon restores a loader only at the same size)."""
    request = data_objects(train_data, for_loading=True) if train_data is not None else {}
    data = common.get("data") or {}
    if not request or data.get("kind") != "energon":  # a JSONL position: train_data.load_state_dict refuses it
        return {}
    saved = data.get("dp_size", saved_run.get("dp"))
    dp = plan.config.parallel.data_parallel_size
    if saved is not None and saved != dp:
        raise CheckpointError(f"the checkpoint's Energon loader positions are per data-parallel rank ({saved} "
                              f"ranks), this run has {dp}: Energon restores a loader only with the "
                              f"same data-parallel size; resume with data-parallel size {saved} (TP, PP and the layout "
                              "may change)")
    return request


def _param_of(optimizer_key: str) -> str:
    """The model tensor an optimizer state key belongs to (``optimizer.state.exp_avg.llm.layer.0.x`` ->
    ``llm.layer.0.x``)."""
    parts = optimizer_key.split(".")
    return ".".join(parts[3:]) if parts[:2] == ["optimizer", "state"] and len(parts) > 3 else optimizer_key


def _check_model(ckpt: Checkpoint, saved_run: dict, spec) -> None:
    """The checkpoint's model sizes must be this run's (a clear message rather than a tensor shape)."""
    if saved_run.get("model") is None:
        return
    saved = spec_from_dict(saved_run["model"]).to_dict()  # fields added since: their defaults
    mine = spec.to_dict()
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


def _check_tensors(ckpt: Checkpoint, model) -> set:
    """Every model tensor this rank needs is in the checkpoint with this global shape; returns the keys of
    every tensor the checkpoint holds."""
    saved = dist_checkpointing.load_tensors_metadata(ckpt.path)
    sd = model_sharded_state_dict(model)
    apply_factories(sd)
    problems = []
    for sh in nested_values(sd):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in saved:
            if not is_adapter(sh.key):  # LoRA adapters missing from the checkpoint start fresh
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
    return set(saved)


def read_global_tensors(path: str, keys) -> dict:
    """The global tensors ``keys`` of the checkpoint folder ``path`` (an ``iter_N``), however it was sharded
    (any TP/PP/DP, layout): read in this process with PyTorch DCP, only those tensors."""
    reader = FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    missing = sorted(k for k in keys if k not in meta)
    if missing:
        raise CheckpointError(f"{path}: model tensor(s) missing: {', '.join(missing[:8])}")
    out = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():  # torch warns of a single-process load even when asked for one (no_dist)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_load(out, storage_reader=reader, no_dist=True)
    return out
