"""Adam's step count per parameter across checkpoints.

torch's Adam/AdamW (megatron-core's optimizer without TE/apex) keeps a step count per parameter
(``state[p]["step"]``) and bias-corrects each parameter's update with its own count, but megatron-core 0.16.1
checkpoints one step for all parameters: its save refuses counts that differ (``MegatronOptimizer.
_extract_common_per_param_step``, ``DistributedOptimizer.state_dict``) and its load gives every parameter the
saved one.  A parameter that starts training on a resume (frozen when the checkpoint was saved) starts at step 0,
as a fresh Adam would; so while a checkpoint is built every count is set to the run's (the largest), which
megatron-core saves as its own, and the counts that differ go to the checkpoint's common state
(``param_steps``: {checkpoint key: step}), set again after a load.  TE/apex's fused Adam keeps one count per
parameter group, not per parameter: there nothing is set.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core import optimizer as mcore_optimizer
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from .state import model_sharded_state_dict


def per_parameter_steps() -> bool:
    """Whether megatron-core's Adam is torch's, which counts steps per parameter (not TE/apex's fused one)."""
    return bool(mcore_optimizer.USING_PYTORCH_OPTIMIZER)


def _model_and_state_params(opt) -> list[tuple]:
    """(model parameter, the inner torch optimizer's parameter holding its state) of one megatron optimizer."""
    index = getattr(opt, "model_param_group_index_map", None)  # distributed: this rank's shards of them
    if index is not None:
        groups = opt.optimizer.param_groups
        return [(p, groups[g]["params"][o]) for p, (g, o) in index.items()]
    if hasattr(opt, "float16_groups"):  # mixed precision: fp32 main copies of the bf16 parameters
        pairs = [(p, m) for ps, ms in zip(opt.float16_groups, opt.fp32_from_float16_groups) for p, m in zip(ps, ms)]
        return pairs + [(p, p) for ps in opt.fp32_from_fp32_groups for p in ps]
    return [(p, p) for g in opt.optimizer.param_groups for p in g["params"]]  # fp32: the parameters themselves


def _adam_states(model, optimizer) -> dict[str, list[dict]]:
    """{checkpoint key: the per-parameter Adam states (holding "step") of that tensor on this rank}."""
    key_of = {id(sh.data): sh.key for sh in nested_values(model_sharded_state_dict(model))
              if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}
    states: dict[str, list[dict]] = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_param, state_param in _model_and_state_params(opt):
            state = opt.optimizer.state.get(state_param)
            if id(model_param) in key_of and state and "step" in state:
                states.setdefault(key_of[id(model_param)], []).append(state)
    return states


def set_steps(model, optimizer, steps: dict[str, float]) -> None:
    """Set the Adam step count of every tensor named in ``steps`` ({checkpoint key: step}) that this rank's
    optimizer holds (others are skipped: frozen now, or on another rank)."""
    for key, states in _adam_states(model, optimizer).items():
        if key in steps:
            for state in states:
                state["step"] = torch.full_like(state["step"], float(steps[key]))


@contextlib.contextmanager
def one_step_for_save(model, optimizer):
    """While a checkpoint is built and saved: every parameter's step count the run's (the largest over all
    ranks), as megatron-core saves one; yields {checkpoint key: step} of the counts that differ (the same on
    every rank), and puts the counts back after."""
    states = _adam_states(model, optimizer)
    mine = {key: float(s["step"]) for key, ss in states.items() for s in ss}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    steps = {key: step for part in everyone for key, step in part.items()}
    run_step = max(steps.values(), default=0.0)
    changed = []
    for ss in states.values():
        for s in ss:
            if float(s["step"]) != run_step:
                changed.append((s, s["step"]))
                s["step"] = torch.full_like(s["step"], run_step)
    try:
        yield {key: step for key, step in sorted(steps.items()) if step != run_step}
    finally:
        for s, step in changed:
            s["step"] = step
