"""Optimizer state across optimizer kinds: a load request pointed at what the saved kind stored, and the
loaded state rebuilt on this optimizer's structure; two megatron-core 0.16.1 problems without TE/apex."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedBase, ShardedTensor,
                                                      ShardedTensorFactory)

from .state import map_leaves


def init_optimizer_state(optimizer) -> None:
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
    """The optimizer kind of a run description (a checkpoint's "run")."""
    return "distributed" if run.get("distributed_optimizer") else "mixed" if run.get("bf16") else "fp32"


def _own_kind(plan) -> str:
    """The optimizer kind of the run ``plan`` (a RunPlan)."""
    return _optimizer_kind({"distributed_optimizer": plan.config.parallel.use_distributed_optimizer,
                            "bf16": plan.config.optim.bf16})


def adapt_optimizer_request(request: dict, saved_run: dict, plan) -> None:
    """Point the requested fp32 main parameters at what the saved optimizer kind stored them under
    (the model's own weights when it trained in fp32). Adam's moments are keyed alike in every kind."""
    saved, mine = _optimizer_kind(saved_run), _own_kind(plan)
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
class _Fresh:
    """In an optimizer load request: state the checkpoint does not hold (a parameter frozen when it was saved),
    kept as this optimizer has it now (``value``: zeros from ``init_optimizer_state``)."""

    value: object


def fresh_optimizer_entries(request: dict, saved_keys) -> list[str]:
    """Point the optimizer load request's tensors that the checkpoint lacks (``saved_keys``: its tensor keys) at
    fresh state: Adam's moments stay this optimizer's zeros, fp32 main parameters become the loaded weights.
    Returns the keys so replaced (empty when the checkpoint trained every parameter this run trains)."""
    saved_keys = set(saved_keys)
    fresh: list[str] = []

    def point(sh):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or sh.key in saved_keys:
            return sh
        fresh.append(sh.key)
        for prefix in _MAIN_PARAM.values():
            if sh.key.startswith(prefix):
                return _FromModel(sh.key[len(prefix):])
        return _Fresh(sh.data)

    dict_list_map_inplace(point, request)
    return fresh


def keep_list_positions(tree):
    """``tree`` with every list that holds a fresh or model-weight placeholder (``fresh_optimizer_entries``) made
    an {index: item} dict, for the load: megatron-core's load drops a list's items that are not sharded and
    closes the gaps (dict_utils.extract_matching_values), which misplaces the sharded items after them (the
    mixed-precision optimizer's ``fp32_from_fp16_params``).  ``load_optimizer``'s rebuild reads them by index."""
    if isinstance(tree, dict):
        return {k: keep_list_positions(v) for k, v in tree.items()}
    if isinstance(tree, list):
        items = [keep_list_positions(v) for v in tree]
        return dict(enumerate(items)) if any(isinstance(v, (_Fresh, _FromModel)) for v in tree) else items
    return tree


@dataclasses.dataclass(frozen=True)
class _FromModel:
    """In an optimizer load request: this tensor is the model's weight under checkpoint key ``key``."""

    key: str


def load_optimizer(optimizer, state: dict, template: dict, model_weights: dict, saved_run: dict, plan,
                   rebuild: bool = False) -> None:
    """Load the optimizer state; ``template`` is the skeleton of the request it was loaded with (this
    optimizer's own structure). Saved by another optimizer kind, the loaded common part (param groups,
    step) has that kind's structure: the state is then rebuilt on the template with the loaded tensors
    and step (``model_weights``: the loaded weights by checkpoint key, for main parameters that were not
    saved apart); so is a state saved by another chain of optimizers (``_other_chain``: another EP size).
    ``rebuild``: rebuild on the template whatever the kinds (some state is fresh: the checkpoint was saved under
    other freeze flags, with other parameter groups)."""
    if rebuild or _optimizer_kind(saved_run) != _own_kind(plan) or _other_chain(template, state):
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


def _other_chain(template, loaded) -> bool:
    """Whether the loaded optimizer state holds parts this optimizer's request (``template``) lacks: the saved
    optimizer was another chain of optimizers (megatron-core gives the experts an optimizer of their own when
    EP > 1: a chain of two, keyed 0 and 1, where EP 1 has one optimizer), whose common part (param groups, step)
    the load merged beside this one's. Adam's moments are keyed by parameter (experts by global index) either way."""
    return isinstance(template, dict) and isinstance(loaded, dict) and bool(set(loaded) - set(template))


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


def skeleton(tree):
    """A load request's structure with its sharded tensors and factories replaced by ``_LOADED``."""
    return map_leaves(tree, lambda v: _LOADED if isinstance(v, ShardedBase) else v)


def _rebuilt(template, loaded, step: torch.Tensor, model_weights: dict):
    """``template``'s structure (a skeleton): loaded tensors where it requested them, this optimizer's own
    values elsewhere (param groups), Adam's step set to ``step``."""
    if template is _LOADED:
        return loaded
    if isinstance(template, _FromModel):
        return model_weights[template.key]
    if isinstance(template, _Fresh):
        return template.value
    if isinstance(template, LocalNonpersistentObject):
        return template.unwrap()
    if isinstance(template, list):  # loaded as a list, or as an {index: item} dict (keep_list_positions)
        def item(i):
            if isinstance(loaded, dict):
                return loaded.get(i)
            return loaded[i] if isinstance(loaded, list) and i < len(loaded) else None

        return [_rebuilt(t, item(i), step, model_weights) for i, t in enumerate(template)]
    if not isinstance(template, dict):
        return template
    out = {k: _rebuilt(t, loaded.get(k) if isinstance(loaded, dict) else None, step, model_weights)
           for k, t in template.items()}
    if "lr" in out and "step" in out:  # a distributed optimizer's param group
        out["step"] = float(step)
    if "state" in out and isinstance(out["state"], dict) and "param_groups" in out:  # a torch optimizer's state
        out["state"]["common_step"] = step
    return out
