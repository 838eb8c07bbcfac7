"""What a checkpoint holds: the sharded state dict of model and optimizer, RNG states, the run's description."""
from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model

from .layout import FORMAT


# The optimizer state in model space, whatever the optimizer kind (megatron-core's fully reshardable form);
# the distributed optimizer's shards are gathered to its data-parallel rank 0 in host memory (over gloo),
# never to every rank nor on the GPU.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                      "distrib_optim_fully_reshardable_mem_efficient": True}


def describe_run(spec, tp: int = 1, pp: int = 1, dp: int = 1, layout: str | None = None,
                 distributed_optimizer: bool = False, bf16: bool = False, seed: int = 0, tokenizer: str | None = None,
                 hf: dict | None = None) -> dict:
    """The run a checkpoint comes from (the common state's "run"): model sizes, the parallel configuration,
    the tokenizer folder and, under "hf", the HF checkpoint the model came from (for omnibal hf export)."""
    return {"format": FORMAT, "model": spec.to_dict(), "tp": tp, "pp": pp, "dp": dp, "layout": layout,
            "distributed_optimizer": bool(distributed_optimizer), "bf16": bool(bf16), "seed": seed,
            "tokenizer": tokenizer, "hf": hf}


def run_description(plan) -> dict:
    """:func:`describe_run` of the run ``plan`` (a RunPlan)."""
    parallel, lora = plan.config.parallel, plan.config.model.lora
    run = describe_run(plan.model_spec, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                       parallel.data_parallel_size, plan.layout_flag, parallel.use_distributed_optimizer,
                       plan.config.optim.bf16, plan.config.optim.seed, plan.tokenizer_model, plan.hf_meta)
    return {**run, "cp": parallel.context_parallel_size, "lora": lora.to_dict() if lora.on else None}


def world_of(run: dict) -> tuple:
    return run["tp"], run["pp"], run["dp"], run.get("cp", 1)


def map_leaves(tree, leaf):
    """``tree`` (nested dicts, lists, tuples) with every other value replaced by ``leaf(value)``."""
    if isinstance(tree, dict):
        return {k: map_leaves(v, leaf) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(v, leaf) for v in tree)
    return leaf(tree)


def _tensor_leaf(value):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return value.item() if isinstance(value, np.generic) else value


def to_tensors(tree):
    """``tree`` with numpy arrays as torch tensors and numpy scalars as Python ones: checkpoints are read
    with torch.load(weights_only=True), which takes tensors and plain Python containers only."""
    return map_leaves(tree, _tensor_leaf)


def to_arrays(tree):
    """The inverse of :func:`to_tensors` for what it changed (tensors back to numpy arrays)."""
    return map_leaves(tree, lambda v: v.numpy() if isinstance(v, torch.Tensor) else v)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": to_tensors(np.random.get_state()), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(to_arrays(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def rng_object(state) -> ShardedObject:
    """This rank's RNG states, one object per (PP, TP, DP) rank (context-parallel ranks share it)."""
    ps = parallel_state
    return ShardedObject("rng_state", state,
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
                          ps.get_data_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                          ps.get_data_parallel_rank()),
                         replica_id=ps.get_context_parallel_rank())  # CP ranks hold copies: the first saves


def data_objects(train_data, for_loading: bool) -> dict:
    """The training data's per-rank position as ShardedObjects (an Energon stream's: one per data-parallel rank,
    ``EnergonBatches.sharded_state``), or {} for a data position held whole in the common state."""
    sharded = getattr(train_data, "sharded_state", None)
    return sharded(for_loading) if sharded is not None else {}


def model_sharded_state_dict(model) -> dict:
    """The model chunks' sharded state dicts in one: the checkpoint keys are global unit names (the same for
    any number of chunks); the dict paths of an interleaved rank's chunk ``c`` start with ``chunk{c}.``."""
    if len(model) == 1:
        return unwrap_model(model[0]).sharded_state_dict()
    return {f"chunk{c}.{path}": sh for c, chunk in enumerate(model)
            for path, sh in unwrap_model(chunk).sharded_state_dict().items()}


def load_model_state(model, state: dict) -> None:
    """Load ``state`` (paths as :func:`model_sharded_state_dict` gives them) into the model chunks."""
    if len(model) == 1:
        unwrap_model(model[0]).load_state_dict(state)
        return
    for c, chunk in enumerate(model):
        prefix = f"chunk{c}."
        unwrap_model(chunk).load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


def sharded_state_dict(model, optimizer, with_optimizer: bool, is_loading: bool) -> dict:
    model_sd = model_sharded_state_dict(model)
    sd = {"model": model_sd}
    if with_optimizer:
        sd["optimizer"] = optimizer.sharded_state_dict(model_sharded_state_dict(model), is_loading=is_loading,
                                                       metadata=OPTIMIZER_METADATA)
    return sd
