"""Train a VLM with megatron-core and OmniBal balancing.

    torchrun --nproc-per-node 4 pretrain_vlm.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Runs on CPU with gloo (automatically when no GPU is visible) and on NVIDIA GPUs with NCCL.
"""
from __future__ import annotations

import sys
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")  # megatron-core's own default
warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true but no accelerator.*")  # Energon's


def main(argv=None) -> dict:
    from megatron.training.arguments import ArgumentError, parse_args, virtual_pipeline_size
    from megatron.training.initialize import (choose_device, distributed_timeout, initialize_distributed, set_seeds,
                                              world_size_from_env)

    world_size = world_size_from_env()
    args = parse_args(argv, world_size)  # checked, never written to: what follows from it is the run plan
    device = choose_device(args.device)
    if args.bf16 and device.type != "cuda":
        raise ArgumentError("--bf16 needs a CUDA device: megatron-core's mixed-precision optimizer takes CUDA "
                            "tensors only (train in fp32 on CPU)")
    initialize_distributed(device, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.context_parallel_size, virtual_pipeline_size(args),
                           args.expert_model_parallel_size, args.expert_tensor_parallel_size,
                           timeout=distributed_timeout(args))
    set_seeds(args.seed)

    from megatron.training.checkpointing import lock

    with lock.held(args.save, args.force_save_lock):  # one run per --save folder, released however main() ends
        return run(args, world_size, device)


def run(args, world_size: int, device) -> dict:
    """The run, once the process groups are up and the --save folder is this run's."""
    import dataclasses
    import os

    import torch.distributed as dist

    from megatron.training import checkpointing, isf, level_summary, setup, training
    from megatron.training.run_plan import plan_run
    from megatron.training.tokenizer_setup import setup_tokenizer

    plan = plan_run(args, world_size, device)  # sizes, model, overlap; completed below as each part is known
    resume = checkpointing.find_checkpoint(args.load, args.ckpt_step) if args.load else None  # checked first
    if args.save and dist.get_rank() == 0:  # before the first save: this run's lineage alone, and room for it
        same = resume is not None and os.path.realpath(args.load) == os.path.realpath(args.save)
        checkpointing.prepare_save_folder(args.save, resume.iteration if same else None, checkpointing.checkpoint_bytes(
            plan.model_spec, None if plan.trainable is None else plan.trainable.trains, args.bf16))
    hf_source = None
    if args.hf_checkpoint:
        from megatron.vlm.hf.convert import HFSource

        hf_source = HFSource.open(args.hf_checkpoint)  # every tensor name and shape checked (headers only)
        plan = dataclasses.replace(plan, hf_meta=hf_source.meta())
    if args.load and resume is None and dist.get_rank() == 0:
        print(f"> no checkpoint in --load {args.load}: starting from scratch", flush=True)
    tokenizer, plan = setup_tokenizer(args, plan)  # the vocabulary padded for the tokenizer
    datasets = setup.build_datasets(args, plan, tokenizer)  # validates every record first
    groups, plan = setup.build_groups(args, plan, datasets[0])  # ISF's caps and mean group size the profile below
    costs = None
    if args.omnibal_partition == "auto" or args.omnibal_recompute == "auto" or args.omnibal_profile:
        costs = setup.unit_costs(args, plan, datasets[0], tokenizer, device, groups)
        if args.omnibal_partition == "none" and args.omnibal_recompute == "none":
            if dist.get_rank() == 0:
                print(f"> profile of {len(costs.units)} units written to {args.omnibal_profile}", flush=True)
            return {"profile": args.omnibal_profile}
    if args.omnibal_partition == "auto":
        layout = setup.balanced_layout(args, plan, costs)
    else:
        layout = setup.choose_layout(args, plan)
    plan = dataclasses.replace(plan, layout=layout)
    if args.omnibal_recompute == "auto":
        adaptive = setup.adaptive_recompute(args, plan, costs, device)
        plan = dataclasses.replace(plan, recompute=adaptive.stages, recompute_plan=adaptive)
    else:
        plan = dataclasses.replace(plan, recompute=setup.recompute_settings(args, plan))
    train_data, valid_data = setup.build_data(args, plan, tokenizer, setup.rank_stage_inputs(plan), datasets,
                                              device.type, groups)  # this stage's inputs only
    model = training.build_model(args, plan, tokenizer.img_context_id, device)
    if hf_source is not None and resume is None:  # this rank's units and TP slices, before the optimizer
        from megatron.core.utils import unwrap_model
        from megatron.vlm.hf.load import load_hf_into_stage

        hf_source.spec = plan.model_spec  # the vocabulary may be padded further for TP
        for chunk in model:  # one stage per model chunk (interleaved pipeline)
            load_hf_into_stage(unwrap_model(chunk), hf_source)
        if dist.get_rank() == 0:
            print(f"> loaded weights from --hf-checkpoint {args.hf_checkpoint}", flush=True)
    optimizer, scheduler = training.build_optimizer(args, plan, model)
    start, consumed = 0, 0
    if resume is not None:
        state = checkpointing.load_checkpoint(resume, args, plan, model, optimizer, scheduler, train_data)
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
    if dist.get_rank() == 0 and plan.trainable is not None and not plan.trainable.all_train:
        from omnibal_ext.model.units import build_units

        print(f"> freezing: {plan.trainable.describe(build_units(plan.model_spec))}", flush=True)
    if dist.get_rank() == 0:
        print(f"> model {plan.model_spec.name}: TP={args.tensor_model_parallel_size} "
              f"PP={args.pipeline_model_parallel_size} DP={plan.data_parallel_size}, "
              f"layout {plan.layout_flag}, "
              + (f"interleaved: {plan.virtual_pipeline_size} model chunks per rank, " if plan.virtual_pipeline_size > 1 else "")
              + f"{plan.num_microbatches} micro-batches per iteration", flush=True)
    sample_times = isf.run_sample_times(args, plan, datasets[0])  # the Dist ratios in time (None: counts only)
    summary = training.train(args, plan, model, optimizer, scheduler, train_data, valid_data, start, consumed,
                             sample_times=sample_times)
    summary["layout"] = list(layout.stage_units)
    if dist.get_rank() == 0:  # what each level did, against Megatron's default (megatron/training/level_summary.py)
        levels = level_summary.summary_lines(
            level_summary.DataLevel(args.omnibal_isf, summary.get("balance"), summary.get("balance_random")),
            level_summary.model_level(plan.model_spec, plan.layout, args.pipeline_model_parallel_size,
                                      plan.virtual_pipeline_size, costs, args.omnibal_partition == "auto"),
            level_summary.memory_level(plan.layout, plan.recompute_plan, args.recompute_plan or
                                       args.recompute_granularity or "none", costs, args.pipeline_model_parallel_size,
                                       args.tensor_model_parallel_size, plan.data_parallel_size,
                                       plan.num_microbatches, args.use_distributed_optimizer,
                                       setup.precision_of(args)))
        print("\n".join("> " + line for line in levels), flush=True)
    return summary


def cli(argv=None) -> int:
    """Run :func:`main` on ``argv`` (default: the command line); a user's mistake (``UserError``) becomes one line
    ``error: ...`` on stderr and exit status 1, as does a run that stopped itself (``RunStopped``: NaN/Inf, a
    --save folder held by another run, a full disk); every other exception keeps its traceback."""
    from megatron.training import cpu_compat
    from megatron.training.arguments import requested_device
    from megatron.training.initialize import choose_device, destroy
    from omnibal_ext.errors import UserError, report

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
