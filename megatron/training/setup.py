"""From parsed arguments and the run plan to what the loop needs: data, layout, recompute plan (the tokenizer:
tokenizer_setup.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import torch.distributed as dist
from megatron.core import parallel_state

from omnibal_ext.data.sampler import GroupBatchSampler, random_groups, random_regroup
from omnibal_ext.memory.recompute import RecomputePlan, StageRecompute
from omnibal_ext.model.layout import default_layout, parse_layout
from omnibal_ext.model.spec import TEXT_LAYER, VISION_LAYER
from omnibal_ext.model.units import build_units, family_of

from megatron.vlm.stage.batches import MicroBatches, StageInputs
from megatron.vlm.stage.components import units_inputs
from megatron.vlm.data.digits import FORMAT_VERSION as DIGITS_FORMAT
from megatron.vlm.data.digits import build_digits_dataset, digits_meta_paths
from megatron.vlm.data.records import DataValidationError, RecordDataset
from megatron.vlm.stage.components import runtime_family

from .arguments import ArgumentError
from .run_plan import RunPlan

DEFAULT_DATASET_SAMPLES = 6000


def data_paths(args, plan: RunPlan) -> tuple[str, str | None]:
    """(train meta, validation meta or None): meta JSONs or annotation JSONLs; builds the default digits data
    on first use."""
    for flag, path in (("--data-path", args.data_path), ("--valid-data-path", args.valid_data_path)):
        if path and not os.path.exists(path):
            raise ArgumentError(f"{flag} {path}: no such file")
        if path and os.path.isdir(path):
            raise ArgumentError(f"{flag} {path} is a folder: give a meta JSON or an annotation JSONL file")
    if args.data_path:
        return args.data_path, args.valid_data_path
    px = runtime_family(plan.model_spec).data.default_image_px(plan.model_spec)
    folder = os.path.join(args.data_cache_dir, f"digits_v{DIGITS_FORMAT}_{px}px")
    if dist.get_rank() == 0:
        build_digits_dataset(folder, num_samples=DEFAULT_DATASET_SAMPLES, seed=0, tile_size=px)
    dist.barrier()
    train, valid = digits_meta_paths(folder)
    return train, args.valid_data_path or valid


def build_dataset(args, plan: RunPlan, tokenizer, meta_path: str) -> RecordDataset:
    """The dataset of ``meta_path`` read with the model family's data side (``FamilyRuntime.data``)."""
    spec = plan.model_spec
    data = runtime_family(spec).data
    images = data.image_rule(args, spec, args.hf_checkpoint)
    # a family declaring video reads video records with its video rule; the others' readers refuse them
    videos = data.video_rule(args, spec, args.hf_checkpoint) if family_of(spec).capabilities.video else None
    # the validation scan (every image decoded) is split over all processes and all-gathered, and kept in
    # --data-cache-dir for the next launch (a restart) of the same data, configuration and tokenizer
    dataset = RecordDataset(meta_path, tokenizer, images, max_seq_length=args.seq_length, seed=args.seed,
                            scan_group=dist.group.WORLD if dist.is_initialized() else None,
                            cache_dir=os.path.join(args.data_cache_dir, "scans"),
                            truncate=args.truncate_long_samples,
                            skip_bad=args.skip_bad_samples, videos=videos)
    skipped = dataset.scan.skipped
    if not skipped:
        return dataset
    report = skipped_report_path(args, meta_path)
    bad = len({line.split(": ", 1)[0] for line in skipped})  # records ("file:line")
    total = bad + len(dataset.scan.rec_line)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(report), exist_ok=True)
        with open(report, "w") as f:
            f.write("".join(f"{line}\n" for line in skipped))
        print(f"> data: {bad} bad record(s) of {meta_path} skipped ({len(skipped)} problem(s)), "
              f"listed in {report}; training on the other {len(dataset)} sample(s)", flush=True)
    if bad > args.max_skipped_fraction * total:  # every rank: the scan is the same on all
        raise DataValidationError(
            f"--skip-bad-samples: {bad} of the {total} records of {meta_path} fail the scan ({bad / total:.0%}), "
            f"more than --max-skipped-fraction {args.max_skipped_fraction}: the data is more likely wrong (an image "
            f"root?) than a few records bad; the first: {skipped[0]} (all in {report})")
    return dataset


def skipped_report_path(args, meta_path: str) -> str:
    """Where --skip-bad-samples lists the records it left out of ``meta_path`` (``file:line: reason``): named after
    the file and a hash of its absolute path, so that two data files of one name keep their own lists."""
    name = os.path.splitext(os.path.basename(meta_path))[0]
    key = hashlib.sha1(os.path.realpath(meta_path).encode()).hexdigest()[:8]
    return os.path.join(args.data_cache_dir, "skipped", f"{name}-{key}.txt")


def build_groups(args, plan: RunPlan, dataset) -> tuple[tuple[list[np.ndarray], np.ndarray | None, object], RunPlan]:
    """((groups, order, regroup), plan): sample groups of the training set (one group = one micro-batch), their
    step order (None in random mode) and the ``regroup(sample_ids) -> (groups, order)`` the sampler uses to
    continue a checkpoint's epoch saved under another configuration (same method, on a subset); with
    --omnibal-isf the plan gets the ISF caps and mean group."""
    if args.omnibal_isf:
        from .isf import isf_groups, isf_regroup

        groups, order, params, mean_group = isf_groups(args, plan, dataset)
        plan = dataclasses.replace(plan, isf_params=params, isf_mean_group=mean_group)
        return (groups, order, isf_regroup(args, plan, dataset)), plan
    # random batching: single-sample groups, a micro-batch takes --micro-batch-size of them (the sampler's
    # ``take``), so the samples of an iteration do not depend on the micro-batch size
    return (random_groups(len(dataset), 1, seed=args.seed), None, random_regroup(1, seed=args.seed)), plan


def build_datasets(args, plan: RunPlan, tokenizer) -> tuple[RecordDataset, RecordDataset | None]:
    """(train, valid or None) datasets; validates every record first (the scan, split over all ranks)."""
    train_meta, valid_meta = data_paths(args, plan)
    train_set = build_dataset(args, plan, tokenizer, train_meta)
    valid_set = build_dataset(args, plan, tokenizer, valid_meta) if valid_meta and args.eval_interval else None
    if args.eval_interval and valid_meta is None and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"> no evaluation: --eval-interval {args.eval_interval} needs --valid-data-path (--data-path "
              f"{args.data_path} has no held-out split)", flush=True)
    return train_set, valid_set


def rank_stage_inputs(plan: RunPlan) -> StageInputs:
    """What this rank's pipeline stage (of ``plan.layout``) reads of a micro-batch, from its units' runtime
    components; interleaved: what its model chunks' units read together (one loader serves every chunk)."""
    units = build_units(plan.model_spec)
    stages = plan.rank_stages(parallel_state.get_pipeline_model_parallel_rank(),
                              parallel_state.get_pipeline_model_parallel_world_size())
    return units_inputs(plan.model_spec, [units[i] for s in stages for i in plan.layout.stage_range(s)])


def build_data(args, plan: RunPlan, tokenizer, inputs: StageInputs | None = None, datasets=None,
               device_type: str = "cpu", groups=None):
    """(train, valid or None) MicroBatches for this rank's stage and data-parallel rank.

    inputs: what the stage reads (``rank_stage_inputs``; None: everything).  datasets: ``build_datasets``'s
    pair (default: built here).  groups: ``build_groups``'s (groups, order, regroup) for the training set (default: made
    here; the trainer makes it before profiling, whose shapes come from it).  The TP rank 0 of a stage
    that reads pixels loads (with --num-workers workers, --prefetch-factor ahead) and broadcasts over the
    TP group; the other stages' ranks load their (image-free) parts themselves, in the training process.

    The train sampler knows the iteration block (dp x ``plan.num_microbatches`` groups), so random-mode
    batches do not depend on DP, and the regroup function, so ``train.load_state_dict`` continues a
    checkpoint saved under another DP (see omnibal_ext.data.sampler).
    """
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    train_set, valid_set = datasets if datasets is not None else build_datasets(args, plan, tokenizer)
    inputs = inputs or StageInputs.everything()
    data_side = runtime_family(plan.model_spec).data
    per_item = train_set.config.images.tokens_per_item  # the loader's image-token check (None: the batcher's own)
    image_tokens = None if per_item is None else (tokenizer.img_context_id, per_item)
    cp = parallel_state.get_context_parallel_world_size()
    # workers only where images are decoded: an image-free stage reads text and the scan's metadata,
    # faster in the training process than through worker processes (scripts/bench_data.py)
    loader = dict(inputs=inputs, num_workers=args.num_workers if inputs.pixels else 0,
                  prefetch_factor=args.prefetch_factor, pin_memory=device_type == "cuda",
                  pad_to_multiple=args.tensor_model_parallel_size if args.sequence_parallel else 1,
                  cp=cp, cp_rank=parallel_state.get_context_parallel_rank(),
                  batcher=data_side.batcher(plan.model_spec, tokenizer.img_context_id, train_set.config.images))
    if inputs.pixels and args.tensor_model_parallel_size > 1:
        loader.update(tp_group=parallel_state.get_tensor_model_parallel_group(),
                      tp_src=parallel_state.get_tensor_model_parallel_src_rank())
    groups, order, regroup = groups if groups is not None else build_groups(args, plan, train_set)[0]
    take = 1 if args.omnibal_isf else args.micro_batch_size  # random: micro-batches slice the global batch
    sampler = GroupBatchSampler(groups, dp, dp_rank, seed=args.seed, order=order,
                                microbatches=plan.num_microbatches, regroup=regroup, take=take)
    train = MicroBatches(train_set, sampler, tokenizer.pad_id, packed=args.omnibal_isf, image_tokens=image_tokens,
                         **loader)
    valid = None
    if valid_set is not None:
        valid = MicroBatches(valid_set, GroupBatchSampler(random_groups(len(valid_set), 1, seed=0), dp, dp_rank, seed=0,
                                                          microbatches=plan.num_microbatches,
                                                          take=args.micro_batch_size), tokenizer.pad_id, packed=False,
                             image_tokens=image_tokens, **loader)
    return train, valid


def choose_layout(args, plan: RunPlan):
    """--pipeline-layout, else Megatron's default layout (over the V x PP stages of an interleaved pipeline)."""
    spec, pp, vpp = plan.model_spec, args.pipeline_model_parallel_size, plan.virtual_pipeline_size
    if args.pipeline_layout:
        return parse_layout(args.pipeline_layout, spec, pp, vpp=vpp)
    return default_layout(spec, pp * vpp)


def recompute_settings(args, plan: RunPlan) -> tuple[StageRecompute, ...]:
    """Per-stage recompute (for ``plan.layout``) from --recompute-granularity (every stage alike) or
    --recompute-plan."""
    layout = plan.layout
    units = build_units(plan.model_spec)
    counts = []
    for rng in layout.stage_slices():
        roles = [units[i].code for i in rng]
        counts.append((roles.count(VISION_LAYER), roles.count(TEXT_LAYER)))
    if args.recompute_plan:
        from omnibal_ext.memory.recompute import parse_recompute_plan

        stages = parse_recompute_plan(args.recompute_plan, layout.num_stages)
        for s, (stage, (nv, nl)) in enumerate(zip(stages, counts)):
            if stage.vit_full_layers > nv or stage.llm_full_layers > nl:
                raise ArgumentError(
                    f"--recompute-plan: stage {s} asks {stage.vit_full_layers} ViT / {stage.llm_full_layers} LLM "
                    f"full layers but holds {nv} / {nl}")
        return tuple(stages)
    if args.recompute_granularity == "full":
        return tuple(StageRecompute(nv, False, nl, False) for nv, nl in counts)
    if args.recompute_granularity == "selective":
        return tuple(StageRecompute(0, True, 0, True) for _ in counts)
    return tuple(StageRecompute() for _ in counts)


# ---------------------------------------------------------------------------------------------
# OmniBal model and memory levels at launch
# ---------------------------------------------------------------------------------------------
def precision_of(args):
    """Static bytes per parameter of this run (megatron's optimizers as configured here)."""
    from omnibal_ext.memory.memory_model import FP32_ADAM, MIXED_BF16_ADAM

    return MIXED_BF16_ADAM if args.bf16 else FP32_ADAM  # fp32: param, main_grad, Adam m/v


def unit_costs(args, plan: RunPlan, dataset, tokenizer, device, groups=None):
    """Costs of every unit: read from --omnibal-profile if it exists, else measured now (and written there; the
    profile times every unit training; an MoE model's also holds the expert load of iteration 1's micro-batches:
    ``routing_profile``, ``groups`` being ``build_groups``'); returned with the run's frozen units applied
    (``plan.trainable``: forward only for a frozen prefix, input-gradient backward below a trainable unit,
    weights-only memory)."""
    costs = _measured_costs(args, plan, dataset, tokenizer, device, groups)
    return costs if plan.trainable is None else plan.trainable.apply(costs)


def _measured_costs(args, plan: RunPlan, dataset, tokenizer, device, groups=None):
    from omnibal_ext.model.costs import CostTable

    from .profiling import profile_for_training
    from .routing_profile import measure_expert_load

    img_context_id = tokenizer.img_context_id

    path = args.omnibal_profile
    if path and os.path.exists(path):
        costs = CostTable.load(path)
        names = [u.name for u in build_units(plan.model_spec)]
        if [u.name for u in costs.units] != names:
            raise ArgumentError(f"--omnibal-profile {path}: its units do not match this model's "
                                f"{len(names)} units (profiled another model?)")
        return costs
    costs = profile_for_training(args, plan, dataset, img_context_id, device)
    if plan.model_spec.language.moe is not None:
        train, _ = build_data(args, plan, tokenizer, StageInputs.everything(), (dataset, None), device.type, groups)
        load = measure_expert_load(args, plan, img_context_id, train, device)
        costs = dataclasses.replace(costs, meta={**costs.meta, "expert_load": load})
    if path and dist.get_rank() == 0:
        costs.save(path)
    return costs


def memory_budget_bytes(args, device) -> float:
    """--omnibal-memory-budget (GiB), else the device's memory less 10% (on CPU: RAM per local rank)."""
    if args.omnibal_memory_budget is not None:
        return args.omnibal_memory_budget * 2**30
    if device.type == "cuda":
        import torch

        return 0.9 * torch.cuda.get_device_properties(device).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return 0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local


def balanced_layout(args, plan: RunPlan, costs):
    """The layout the partition search finds for ``costs`` (printed beside Megatron's default)."""
    from omnibal_ext.model.partition import evaluate_layout, search_partition

    pp, vpp = args.pipeline_model_parallel_size, plan.virtual_pipeline_size
    report = search_partition(costs, pp, vpp=vpp)  # over the V x PP virtual stages
    default = evaluate_layout(costs, default_layout(plan.model_spec, pp * vpp), pp)
    if dist.get_rank() == 0:
        fmt = lambda r: ", ".join(f"{t * 1e3:.2f}" for t in r.stage_times_s)  # noqa: E731
        print(f"> omnibal partition: layout {report.flag}; predicted stage times (ms/micro-batch) "
              f"[{fmt(report)}], bottleneck/mean {report.bottleneck_over_mean:.3f} "
              f"(default [{fmt(default)}], {default.bottleneck_over_mean:.3f}); search {report.search_seconds * 1e3:.1f} ms",
              flush=True)
    return report.layout


def adaptive_recompute(args, plan: RunPlan, costs, device) -> RecomputePlan:
    """The fastest per-stage recompute of ``plan.layout`` whose predicted peak fits the memory budget."""
    from omnibal_ext.memory.recompute import format_recompute_plan, plan_recompute

    budget = memory_budget_bytes(args, device)
    chosen = plan_recompute(costs, plan.layout, budget, args.pipeline_model_parallel_size,
                            args.tensor_model_parallel_size, plan.data_parallel_size, plan.num_microbatches,
                            distributed_optimizer=args.use_distributed_optimizer, precision=precision_of(args))
    if dist.get_rank() == 0:
        peaks = ", ".join(f"{b / 2**20:.2f}" for b in chosen.stage_peak_bytes)
        print(f"> omnibal recompute: plan {format_recompute_plan(chosen.stages)} for a budget of "
              f"{budget / 2**20:.2f} MiB; predicted peak per stage (MiB) [{peaks}]", flush=True)
    return chosen
