"""Train a VLM with megatron-core and OmniBal balancing.

    torchrun --nproc-per-node 4 pretrain_vlm.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Runs on CPU with gloo (automatically when no GPU is visible) and on NVIDIA GPUs with NCCL.
"""
from __future__ import annotations

import os
import sys

from megatron.training import known_warnings

known_warnings.silence()  # first: the imports below load megatron-core, which warns as it loads
import torch.distributed as dist  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

from megatron.training import checkpointing, cpu_compat, isf, level_summary, setup, training  # noqa: E402
from megatron.training.arguments import parse_config, requested_device  # noqa: E402
from megatron.training.checkpointing import lock  # noqa: E402
from megatron.training.config import RunConfig  # noqa: E402
from megatron.training.flags import ArgumentError  # noqa: E402
from megatron.training.initialize import (choose_device, destroy, initialize_distributed, set_seeds,  # noqa: E402
                                          world_size_from_env)
from megatron.training.tokenizer_setup import setup_tokenizer, tokenizer_folder  # noqa: E402
from megatron.vlm.hf.convert import HFSource  # noqa: E402
from megatron.vlm.hf.load import load_hf_into_stage  # noqa: E402
from omnibal_ext.errors import UserError, report  # noqa: E402
from omnibal_ext.model.units import build_units  # noqa: E402


def main(argv=None) -> dict:
    world_size = world_size_from_env()
    config = parse_config(argv, world_size)  # every flag checked and typed: nothing below reads the flags
    parallel = config.parallel
    device = choose_device(parallel.device)
    if config.optim.bf16 and device.type != "cuda":
        raise ArgumentError("--bf16 needs a CUDA device: megatron-core's mixed-precision optimizer takes CUDA "
                            "tensors only (train in fp32 on CPU)")
    initialize_distributed(device, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                           parallel.context_parallel_size, parallel.virtual_pipeline_size,
                           parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size,
                           timeout=parallel.timeout)
    set_seeds(config.optim.seed)
    # one run per --save folder, released however main() ends
    with lock.held(config.checkpoint.save, config.checkpoint.force_save_lock):
        return run(config, device)


def run(config: RunConfig, device) -> dict:
    """The run, once the process groups are up and the --save folder is this run's."""
    parallel, ckpt = config.parallel, config.checkpoint
    load, save = ckpt.load, ckpt.save
    resume = checkpointing.find_checkpoint(load, ckpt.ckpt_step) if load else None  # checked first
    if save and dist.get_rank() == 0:  # before the first save: this run's lineage alone, and room for it
        same = resume is not None and os.path.realpath(load) == os.path.realpath(save)
        checkpointing.prepare_save_folder(save, resume.iteration if same else None, checkpointing.checkpoint_bytes(
            config.model.spec, config.model.trainable.trains, config.optim.bf16))
    hf_checkpoint = config.model.hf_checkpoint
    # every tensor name and shape checked (headers only)
    hf_source = HFSource.open(hf_checkpoint) if hf_checkpoint else None
    if load and resume is None and dist.get_rank() == 0:
        print(f"> no checkpoint in --load {load}: starting from scratch", flush=True)
    tokenizer, spec = setup_tokenizer(config)  # the model's vocabulary padded for the tokenizer
    datasets = setup.build_datasets(config, spec, tokenizer)  # validates every record first
    groups = setup.build_groups(config, spec, datasets[0])  # ISF's caps and mean group size the profile below
    costs = None
    if config.balance.profiles:
        costs = setup.unit_costs(config, spec, groups, datasets[0], tokenizer, device)
        if config.balance.profile_only:
            if dist.get_rank() == 0:
                print(f"> profile of {len(costs.units)} units written to {config.balance.profile}", flush=True)
            return {"profile": config.balance.profile}
    # the layout and the recompute chosen (searched and planned from the costs with --omnibal-*): the whole plan
    plan = setup.build_run_plan(config, spec, device, costs, tokenizer_folder(config),
                                None if hf_source is None else hf_source.meta())
    train_data, valid_data = setup.build_data(config, spec, tokenizer, setup.rank_stage_inputs(plan), datasets,
                                              device.type, groups)  # this stage's inputs only
    model = training.build_model(plan, tokenizer.img_context_id, device)
    if hf_source is not None and resume is None:  # this rank's units and TP slices, before the optimizer
        hf_source.spec = plan.model_spec  # the vocabulary may be padded further for TP
        for chunk in model:  # one stage per model chunk (interleaved pipeline)
            load_hf_into_stage(unwrap_model(chunk), hf_source)
        if dist.get_rank() == 0:
            print(f"> loaded weights from --hf-checkpoint {hf_checkpoint}", flush=True)
    optimizer, scheduler = training.build_optimizer(plan, model)
    start, consumed = 0, 0
    if resume is not None:
        state = checkpointing.load_checkpoint(resume, plan, model, optimizer, scheduler, train_data)
        if "data" in state:
            train_data.load_state_dict(checkpointing.to_arrays(state["data"]))
            how = train_data.resumed
            if how != "continued" and dist.get_rank() == 0:
                print("> the checkpoint's data order differs from this run's (other batching, seed or batch "
                      "sizes, or written by an earlier release): the data order restarts: "
                      + ("the samples of its epoch not yet served come first, in this run's order, then this "
                         "run's epochs" if how == "regrouped" else "from its next epoch, in this run's order"),
                      flush=True)
        start, consumed = state.get("iteration", 0), state.get("consumed_samples", 0)
    trainable = config.model.trainable
    if dist.get_rank() == 0 and not trainable.all_train:
        print(f"> freezing: {trainable.describe(build_units(plan.model_spec))}", flush=True)
    if dist.get_rank() == 0:
        print(f"> model {plan.model_spec.name}: TP={parallel.tensor_model_parallel_size} "
              f"PP={parallel.pipeline_model_parallel_size} DP={parallel.data_parallel_size}, "
              f"layout {plan.layout_flag}, "
              + (f"interleaved: {parallel.virtual_pipeline_size} model chunks per rank, "
                 if parallel.virtual_pipeline_size > 1 else "")
              + f"{config.optim.num_microbatches} micro-batches per iteration", flush=True)
    sample_times = isf.run_sample_times(config, spec, datasets[0])  # the Dist ratios in time (None: counts only)
    try:
        summary = training.train(plan, model, optimizer, scheduler, train_data, valid_data, start, consumed,
                                 sample_times=sample_times)
    finally:  # the loaders' worker processes stop now (megatron/vlm/data/loader_workers.py)
        for data in (train_data, valid_data):
            if data is not None:
                data.close()
    summary["layout"] = list(plan.layout.stage_units)
    if dist.get_rank() == 0:  # what each level did, against Megatron's default (megatron/training/level_summary.py)
        balance = config.balance
        levels = level_summary.summary_lines(
            level_summary.DataLevel(balance.isf, summary.get("balance"), summary.get("balance_random")),
            level_summary.model_level(plan.model_spec, plan.layout, parallel.pipeline_model_parallel_size,
                                      parallel.virtual_pipeline_size, costs, balance.partition == "auto"),
            level_summary.memory_level(plan.layout, plan.adaptive_recompute, balance.recompute_plan or
                                       balance.recompute_granularity or "none", costs,
                                       parallel.pipeline_model_parallel_size, parallel.tensor_model_parallel_size,
                                       parallel.data_parallel_size, config.optim.num_microbatches,
                                       parallel.use_distributed_optimizer, setup.precision_of(config.optim)))
        print("\n".join("> " + line for line in levels), flush=True)
    return summary


def cli(argv=None) -> int:
    """Run :func:`main` on ``argv`` (default: the command line); a user's mistake (``UserError``) becomes one line
    ``error: ...`` on stderr and exit status 1, as does a run that stopped itself (``RunStopped``: NaN/Inf, a
    --save folder held by another run, a full disk); every other exception keeps its traceback."""
    try:
        with cpu_compat.patched_for(choose_device(requested_device(argv))):  # a CPU run, teardown included
            try:
                main(argv)
            finally:
                destroy()
    except UserError as e:  # bad flags or data, or a run that stopped itself: one clear line per rank, no traceback
        return report(e)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
