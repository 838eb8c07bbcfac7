"""From the run's configuration to what the loop needs: the datasets and their groups, the unit costs, the layout
and the recompute, made whole in the :class:`RunPlan` (``build_run_plan``); then the loaders of this rank's stage
(the tokenizer: tokenizer_setup.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from omnibal_ext.data.isf import ISFParams
from omnibal_ext.data.sampler import GroupBatchSampler, random_groups, random_regroup
from omnibal_ext.memory.memory_model import FP32_ADAM, MIXED_BF16_ADAM
from omnibal_ext.memory.recompute import (RecomputePlan, StageRecompute, format_recompute_plan, parse_recompute_plan,
                                          plan_recompute)
from omnibal_ext.model.costs import CostTable
from omnibal_ext.model.layout import PipelineLayout, default_layout, parse_layout
from omnibal_ext.model.partition import evaluate_layout, search_partition
from omnibal_ext.model.spec import TEXT_LAYER, VISION_LAYER
from omnibal_ext.model.units import ModelSpec, build_units, family_of

from megatron.vlm.stage.batches import MicroBatches, StageInputs
from megatron.vlm.stage.components import runtime_family, units_inputs
from megatron.vlm.data.digits import FORMAT_VERSION as DIGITS_FORMAT
from megatron.vlm.data.digits import build_digits_dataset, digits_meta_paths
from megatron.vlm.data.energon.dataset import EnergonSource
from megatron.vlm.data.records import DataValidationError, RecordDataset

from .config import BalanceConfig, DataConfig, OptimConfig, RunConfig
from .flags import ArgumentError
from .energon_data import build_energon_data, energon_sources, is_energon, profiling_refused
from .isf import MeanGroup, isf_groups, isf_regroup
from .profiling import profile_for_training
from .routing_profile import measure_expert_load
from .run_plan import RunPlan, resolve_overlap

DEFAULT_DATASET_SAMPLES = 6000


def check_data_paths(data: DataConfig, folders: bool) -> None:
    """--data-path and --valid-data-path exist; ``folders``: they may be folders (an Energon dataset), else they
    must be files (a meta JSON or an annotation JSONL)."""
    for flag, path in (("--data-path", data.data_path), ("--valid-data-path", data.valid_data_path)):
        if path and not os.path.exists(path):
            raise ArgumentError(f"{flag} {path}: no such file")
        if path and not folders and os.path.isdir(path):
            raise ArgumentError(f"{flag} {path} is a folder: give a meta JSON or an annotation JSONL file")


def data_paths(data: DataConfig, spec: ModelSpec) -> tuple[str, str | None]:
    """(train meta, validation meta or None): meta JSONs or annotation JSONLs; builds the default digits data
    (images for ``spec``) on first use."""
    check_data_paths(data, folders=False)
    if data.data_path:
        return data.data_path, data.valid_data_path
    px = runtime_family(spec).data.default_image_px(spec)
    folder = os.path.join(data.data_cache_dir, f"digits_v{DIGITS_FORMAT}_{px}px")
    if dist.get_rank() == 0:
        build_digits_dataset(folder, num_samples=DEFAULT_DATASET_SAMPLES, seed=0, tile_size=px)
    dist.barrier()
    train, valid = digits_meta_paths(folder)
    return train, data.valid_data_path or valid


def build_dataset(config: RunConfig, spec: ModelSpec, tokenizer, meta_path: str) -> RecordDataset:
    """The dataset of ``meta_path`` read with the model family's data side (``FamilyRuntime.data``)."""
    data, hf = config.data, config.model.hf_checkpoint
    side = runtime_family(spec).data
    images = side.image_rule(data.media, spec, hf)
    # a family declaring video reads video records with its video rule; the others' readers refuse them
    videos = side.video_rule(data.media, spec, hf) if family_of(spec).capabilities.video else None
    # the validation scan (every image decoded) is split over all processes and all-gathered, and kept in
    # --data-cache-dir for the next launch (a restart) of the same data, configuration and tokenizer
    dataset = RecordDataset(meta_path, tokenizer, images, max_seq_length=data.seq_length, seed=config.optim.seed,
                            scan_group=dist.group.WORLD if dist.is_initialized() else None,
                            cache_dir=os.path.join(data.data_cache_dir, "scans"),
                            truncate=data.truncate_long_samples,
                            skip_bad=data.skip_bad_samples, videos=videos)
    skipped = dataset.scan.skipped
    if not skipped:
        return dataset
    report = skipped_report_path(data, meta_path)
    bad = len({line.split(": ", 1)[0] for line in skipped})  # records ("file:line")
    total = bad + len(dataset.scan.rec_line)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(report), exist_ok=True)
        with open(report, "w") as f:
            f.write("".join(f"{line}\n" for line in skipped))
        print(f"> data: {bad} bad record(s) of {meta_path} skipped ({len(skipped)} problem(s)), "
              f"listed in {report}; training on the other {len(dataset)} sample(s)", flush=True)
    if bad > data.max_skipped_fraction * total:  # every rank: the scan is the same on all
        raise DataValidationError(
            f"--skip-bad-samples: {bad} of the {total} records of {meta_path} fail the scan ({bad / total:.0%}), "
            f"more than --max-skipped-fraction {data.max_skipped_fraction}: the data is more likely wrong (an image "
            f"root?) than a few records bad; the first: {skipped[0]} (all in {report})")
    return dataset


def skipped_report_path(data: DataConfig, meta_path: str) -> str:
    """Where --skip-bad-samples lists the records it left out of ``meta_path`` (``file:line: reason``): named after
    the file and a hash of its absolute path, so that two data files of one name keep their own lists."""
    name = os.path.splitext(os.path.basename(meta_path))[0]
    key = hashlib.sha1(os.path.realpath(meta_path).encode()).hexdigest()[:8]
    return os.path.join(data.data_cache_dir, "skipped", f"{name}-{key}.txt")


@dataclass(frozen=True)
class SampleGroups:
    """The training set's groups (one group = one micro-batch) and how the sampler orders and regroups them."""

    groups: list[np.ndarray]
    """Sample indices of each group (random batching: one sample each, a micro-batch takes --micro-batch-size)."""
    order: np.ndarray | None
    """ISF's balanced step order of the groups; None in random mode (the sampler shuffles)."""
    regroup: Callable[[np.ndarray], tuple[list[np.ndarray], np.ndarray | None]]
    """``regroup(sample_ids) -> (groups, order)``: the same method on a subset, with which the sampler continues a
    checkpoint's epoch saved under another configuration."""
    isf_params: ISFParams | None = None
    """With --omnibal-isf: the caps of a group (given or searched; memory is planned for them); else None."""
    mean_group: MeanGroup | None = None
    """With --omnibal-isf: the mean group (what a micro-batch costs on average); else None."""


def build_groups(config: RunConfig, spec: ModelSpec, dataset) -> SampleGroups | None:
    """The groups of the training set ``dataset``: ISF's with --omnibal-isf, else random single samples; None for an
    Energon dataset (grouped online, per step: energon_data.py)."""
    if isinstance(dataset, EnergonSource):
        return None
    if config.balance.isf:
        found = isf_groups(config, spec, dataset)
        return SampleGroups(found.groups, found.order, isf_regroup(config, spec, dataset, found.params),
                            found.params, found.mean_group)
    # random batching: single-sample groups, a micro-batch takes --micro-batch-size of them (the sampler's
    # ``take``), so the samples of an iteration do not depend on the micro-batch size
    seed = config.optim.seed
    return SampleGroups(random_groups(len(dataset), 1, seed=seed), None, random_regroup(1, seed=seed))


def build_datasets(config: RunConfig, spec: ModelSpec, tokenizer) -> tuple[RecordDataset, RecordDataset | None]:
    """(train, valid or None) datasets; validates every record first (the scan, split over all ranks); an Energon
    --data-path: its ``EnergonSource``s, checked, nothing scanned (energon_data.py)."""
    if is_energon(config.data.data_path):
        check_data_paths(config.data, folders=True)
        return energon_sources(config, spec)
    train_meta, valid_meta = data_paths(config.data, spec)
    train_set = build_dataset(config, spec, tokenizer, train_meta)
    eval_interval = config.log.eval_interval
    valid_set = build_dataset(config, spec, tokenizer, valid_meta) if valid_meta and eval_interval else None
    if eval_interval and valid_meta is None and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"> no evaluation: --eval-interval {eval_interval} needs --valid-data-path (--data-path "
              f"{config.data.data_path} has no held-out split)", flush=True)
    return train_set, valid_set


def rank_stage_inputs(plan: RunPlan) -> StageInputs:
    """What this rank's pipeline stage (of ``plan.layout``) reads of a micro-batch, from its units' runtime
    components; interleaved: what its model chunks' units read together (one loader serves every chunk)."""
    units = build_units(plan.model_spec)
    stages = plan.rank_stages(parallel_state.get_pipeline_model_parallel_rank(),
                              parallel_state.get_pipeline_model_parallel_world_size())
    return units_inputs(plan.model_spec, [units[i] for s in stages for i in plan.layout.stage_range(s)])


def build_data(config: RunConfig, spec: ModelSpec, tokenizer, inputs: StageInputs | None = None, datasets=None,
               device_type: str = "cpu", groups: SampleGroups | None = None):
    """(train, valid or None) MicroBatches of the model ``spec`` for this rank's stage and data-parallel rank.

    inputs: what the stage reads (``rank_stage_inputs``; None: everything).  datasets: ``build_datasets``'s
    pair (default: built here).  groups: ``build_groups``' for the training set (default: made here; the trainer
    makes them before profiling, whose shapes come from them).  The TP rank 0 of a stage that reads pixels loads
    (with --num-workers workers, --prefetch-factor ahead) and broadcasts over the TP group; the other stages'
    ranks load their (image-free) parts themselves, in the training process.

    The train sampler knows the iteration block (dp x ``optim.num_microbatches`` groups), so random-mode
    batches do not depend on DP, and the regroup function, so ``train.load_state_dict`` continues a
    checkpoint saved under another DP (see omnibal_ext.data.sampler).
    """
    data, optim, parallel = config.data, config.optim, config.parallel
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    train_set, valid_set = datasets if datasets is not None else build_datasets(config, spec, tokenizer)
    inputs = inputs or StageInputs.everything()
    if isinstance(train_set, EnergonSource):
        return build_energon_data(config, spec, tokenizer, (train_set, valid_set), inputs, device_type)
    data_side = runtime_family(spec).data
    per_item = train_set.config.images.tokens_per_item  # the loader's image-token check (None: the batcher's own)
    image_tokens = None if per_item is None else (tokenizer.img_context_id, per_item)
    cp = parallel_state.get_context_parallel_world_size()
    # workers only where images are decoded: an image-free stage reads text and the scan's metadata,
    # faster in the training process than through worker processes (scripts/bench_data.py)
    loader = dict(inputs=inputs, num_workers=data.num_workers if inputs.pixels else 0,
                  prefetch_factor=data.prefetch_factor, pin_memory=device_type == "cuda",
                  pad_to_multiple=parallel.sequence_parallel_tp,
                  cp=cp, cp_rank=parallel_state.get_context_parallel_rank(),
                  batcher=data_side.batcher(spec, tokenizer.img_context_id, train_set.config.images))
    if inputs.pixels and parallel.tensor_model_parallel_size > 1:
        loader.update(tp_group=parallel_state.get_tensor_model_parallel_group(),
                      tp_src=parallel_state.get_tensor_model_parallel_src_rank())
    groups = groups if groups is not None else build_groups(config, spec, train_set)
    isf = config.balance.isf
    take = 1 if isf else optim.micro_batch_size  # random: micro-batches slice the global batch
    sampler = GroupBatchSampler(groups.groups, dp, dp_rank, seed=optim.seed, order=groups.order,
                                microbatches=optim.num_microbatches, regroup=groups.regroup, take=take)
    train = MicroBatches(train_set, sampler, tokenizer.pad_id, packed=isf, image_tokens=image_tokens,
                         **loader)
    valid = None
    if valid_set is not None:
        valid = MicroBatches(valid_set, GroupBatchSampler(random_groups(len(valid_set), 1, seed=0), dp, dp_rank, seed=0,
                                                          microbatches=optim.num_microbatches,
                                                          take=optim.micro_batch_size), tokenizer.pad_id, packed=False,
                             image_tokens=image_tokens, **loader)
    return train, valid


def choose_layout(config: RunConfig, spec: ModelSpec) -> PipelineLayout:
    """--pipeline-layout, else Megatron's default layout (over the V x PP stages of an interleaved pipeline)."""
    pp, vpp = config.parallel.pipeline_model_parallel_size, config.parallel.virtual_pipeline_size
    if config.balance.pipeline_layout:
        return parse_layout(config.balance.pipeline_layout, spec, pp, vpp=vpp)
    return default_layout(spec, pp * vpp)


def recompute_settings(balance: BalanceConfig, spec: ModelSpec, layout: PipelineLayout) -> tuple[StageRecompute, ...]:
    """Per-stage recompute (for ``layout``) from --recompute-granularity (every stage alike) or --recompute-plan."""
    units = build_units(spec)
    counts = []
    for rng in layout.stage_slices():
        roles = [units[i].code for i in rng]
        counts.append((roles.count(VISION_LAYER), roles.count(TEXT_LAYER)))
    if balance.recompute_plan:
        stages = parse_recompute_plan(balance.recompute_plan, layout.num_stages)
        for s, (stage, (nv, nl)) in enumerate(zip(stages, counts)):
            if stage.vit_full_layers > nv or stage.llm_full_layers > nl:
                raise ArgumentError(
                    f"--recompute-plan: stage {s} asks {stage.vit_full_layers} ViT / {stage.llm_full_layers} LLM "
                    f"full layers but holds {nv} / {nl}")
        return tuple(stages)
    if balance.recompute_granularity == "full":
        return tuple(StageRecompute(nv, False, nl, False) for nv, nl in counts)
    if balance.recompute_granularity == "selective":
        return tuple(StageRecompute(0, True, 0, True) for _ in counts)
    return tuple(StageRecompute() for _ in counts)


# ---------------------------------------------------------------------------------------------
# OmniBal model and memory levels at launch
# ---------------------------------------------------------------------------------------------
def precision_of(optim: OptimConfig):
    """Static bytes per parameter of this run (megatron's optimizers as configured here)."""
    return MIXED_BF16_ADAM if optim.bf16 else FP32_ADAM  # fp32: param, main_grad, Adam m/v


def unit_costs(config: RunConfig, spec: ModelSpec, groups: SampleGroups, dataset, tokenizer, device) -> CostTable:
    """Costs of every unit of the model ``spec``: read from --omnibal-profile if it exists, else measured now (and
    written there; the profile times every unit training at the micro-batches ``groups`` make; an MoE model's also
    holds the expert load of iteration 1's micro-batches: ``routing_profile``); returned with the run's frozen units
    applied (``model.trainable``: forward only for a frozen prefix, input-gradient backward below a trainable unit,
    weights-only memory)."""
    return config.model.trainable.apply(_measured_costs(config, spec, groups, dataset, tokenizer, device))


def _measured_costs(config: RunConfig, spec: ModelSpec, groups: SampleGroups, dataset, tokenizer, device) -> CostTable:
    img_context_id = tokenizer.img_context_id
    path = config.balance.profile
    if isinstance(dataset, EnergonSource) and not (path and os.path.exists(path)):
        raise profiling_refused(dataset)
    if path and os.path.exists(path):
        costs = CostTable.load(path)
        names = [u.name for u in build_units(spec)]
        if [u.name for u in costs.units] != names:
            raise ArgumentError(f"--omnibal-profile {path}: its units do not match this model's "
                                f"{len(names)} units (profiled another model?)")
        return costs
    costs = profile_for_training(config, spec, groups, dataset, img_context_id, device)
    if spec.language.moe is not None:
        train, _ = build_data(config, spec, tokenizer, StageInputs.everything(), (dataset, None), device.type, groups)
        load = measure_expert_load(config, spec, img_context_id, train, device)
        costs = dataclasses.replace(costs, meta={**costs.meta, "expert_load": load})
    if path and dist.get_rank() == 0:
        costs.save(path)
    return costs


def memory_budget_bytes(balance: BalanceConfig, device) -> float:
    """--omnibal-memory-budget (GiB), else the device's memory less 10% (on CPU: RAM per local rank)."""
    if balance.memory_budget_gib is not None:
        return balance.memory_budget_gib * 2**30
    if device.type == "cuda":
        return 0.9 * torch.cuda.get_device_properties(device).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return 0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local


def balanced_layout(config: RunConfig, spec: ModelSpec, costs: CostTable) -> PipelineLayout:
    """The layout the partition search finds for ``costs`` (printed beside Megatron's default)."""
    pp, vpp = config.parallel.pipeline_model_parallel_size, config.parallel.virtual_pipeline_size
    report = search_partition(costs, pp, vpp=vpp)  # over the V x PP virtual stages
    default = evaluate_layout(costs, default_layout(spec, pp * vpp), pp)
    if dist.get_rank() == 0:
        fmt = lambda r: ", ".join(f"{t * 1e3:.2f}" for t in r.stage_times_s)  # noqa: E731
        print(f"> omnibal partition: layout {report.flag}; predicted stage times (ms/micro-batch) "
              f"[{fmt(report)}], bottleneck/mean {report.bottleneck_over_mean:.3f} "
              f"(default [{fmt(default)}], {default.bottleneck_over_mean:.3f}); search {report.search_seconds * 1e3:.1f} ms",
              flush=True)
    return report.layout


def adaptive_recompute(config: RunConfig, layout: PipelineLayout, costs: CostTable, device) -> RecomputePlan:
    """The fastest per-stage recompute of ``layout`` whose predicted peak fits the memory budget."""
    budget = memory_budget_bytes(config.balance, device)
    parallel = config.parallel
    chosen = plan_recompute(costs, layout, budget, parallel.pipeline_model_parallel_size,
                            parallel.tensor_model_parallel_size, parallel.data_parallel_size,
                            config.optim.num_microbatches, distributed_optimizer=parallel.use_distributed_optimizer,
                            precision=precision_of(config.optim))
    if dist.get_rank() == 0:
        peaks = ", ".join(f"{b / 2**20:.2f}" for b in chosen.stage_peak_bytes)
        print(f"> omnibal recompute: plan {format_recompute_plan(chosen.stages)} for a budget of "
              f"{budget / 2**20:.2f} MiB; predicted peak per stage (MiB) [{peaks}]", flush=True)
    return chosen


def build_run_plan(config: RunConfig, spec: ModelSpec, device, costs: CostTable | None = None,
                   tokenizer_model: str | None = None, hf_meta: dict | None = None) -> RunPlan:
    """The complete plan of the run: the model ``spec`` (its vocabulary padded for the tokenizer of
    ``tokenizer_model``), the layout (--omnibal-partition auto: searched for ``costs``, the units' costs; else
    --pipeline-layout or Megatron's default) and the recompute of each stage (--omnibal-recompute auto: planned
    for ``costs`` within the memory budget of ``device``; else --recompute-*), the overlap for ``device``."""
    balance = config.balance
    layout = balanced_layout(config, spec, costs) if balance.partition == "auto" else choose_layout(config, spec)
    adaptive = adaptive_recompute(config, layout, costs, device) if balance.recompute == "auto" else None
    recompute = adaptive.stages if adaptive is not None else recompute_settings(balance, spec, layout)
    overlap_grad, overlap_param = resolve_overlap(config.parallel, device)
    return RunPlan(config=config, model_spec=spec, tokenizer_model=tokenizer_model, layout=layout,
                   recompute=tuple(recompute), overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param,
                   hf_meta=hf_meta, adaptive_recompute=adaptive)
