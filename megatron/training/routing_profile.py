"""Expert load on real data, for the profile (``omnibal profile``, ``--omnibal-profile``): tokens per expert per
MoE layer over the first training iteration's micro-batches, and from them the expert-parallel imbalance at every
EP size (``omnibal_ext.model.expert_load``), which the cost model and ``omnibal plan`` read.

The routing depends on every layer before a router, so the whole model runs: one stage of every unit on each rank,
built as the trainer builds it (per-unit seeds, ``SeededSequentialMLP``'s per-expert seeds: the weights of training's
first step whatever the layout, EP or TP) and loaded from ``--hf-checkpoint`` where one is given. It runs forward
only, in evaluation mode (no aux-loss is recorded, no dropout), with gradients enabled (``ExpertLoad`` counts those
forwards), on this data-parallel rank's micro-batches of iteration 1 (the trainer's loader, ``setup.build_data``).
The counts are summed over the data-parallel ranks (with context parallelism: its ranks' token shares) and, under
sequence parallelism, the tensor-parallel ranks (each routes 1/TP of the tokens): every rank gets the iteration's
counts, those ``--log-expert-load`` writes for iteration 1. The copy is freed before training builds its model.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from omnibal_ext.model.expert_load import expert_load_meta
from omnibal_ext.model.units import ModelSpec, build_units

from megatron.vlm.layers.layer_impl import resolve_layer_impl
from megatron.vlm.layers.moe import ExpertLoad
from megatron.vlm.hf.convert import HFSource
from megatron.vlm.hf.load import load_hf_into_stage
from megatron.vlm.stage.build import StageBuild, build_stage

from .config import ParallelConfig, RunConfig


def whole_model(config: RunConfig, spec: ModelSpec, img_context_id: int, device: torch.device):
    """Every unit of ``spec`` (the run's model) as one stage, with training's initial (or ``--hf-checkpoint``'s)
    weights."""
    model, parallel = config.model, config.parallel
    dtype = config.optim.params_dtype
    impl = resolve_layer_impl(model.transformer_impl, model.attention_backend, device, parallel.context_parallel_size,
                              torch_layers_only=parallel.sequence_parallel)
    stage = build_stage(StageBuild(
        spec, range(len(build_units(spec))), tp=parallel.tensor_model_parallel_size, dtype=dtype,
        impl=impl, seed=config.optim.seed, img_context_id=img_context_id, on_cpu=device.type == "cpu",
        sequence_parallel=parallel.sequence_parallel,
        cp=parallel.context_parallel_size, initialize=not model.hf_checkpoint, moe_run=model.moe_run))
    stage.to(device=device, dtype=dtype)
    if model.hf_checkpoint:
        source = HFSource.open(model.hf_checkpoint)
        source.spec = spec  # the vocabulary padded for the tokenizer and TP, as the trainer loads it
        load_hf_into_stage(stage, source)
    return stage.eval()


def sum_over_token_shares(counts: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """``counts`` summed over the ranks that routed other tokens (module docstring), in place."""
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1:
        dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
    return counts


def measure_expert_load(config: RunConfig, spec: ModelSpec, img_context_id: int, batches, device: torch.device) -> dict:
    """The profile's ``expert_load`` (``omnibal_ext.model.expert_load``) of iteration 1's micro-batches, taken from
    ``batches`` (the trainer's loader over every unit's inputs: ``setup.build_data``)."""
    moe = spec.language.moe
    microbatches = config.optim.num_microbatches
    stage = whole_model(config, spec, img_context_id, device)
    load = ExpertLoad().attach([stage])
    try:
        with torch.enable_grad():
            for batch in itertools.islice(batches, microbatches):
                stage.set_input_tensor(None)
                stage(batch.to(device))
    finally:
        load.detach()
    layers = list(moe.moe_layers)
    counts = torch.stack([load.counts.get(k, torch.zeros(moe.num_experts, dtype=torch.float64)) for k in layers])
    counts = sum_over_token_shares(counts, config.parallel)
    del stage
    return expert_load_meta(dict(zip(layers, counts.tolist())), microbatches)
