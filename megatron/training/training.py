"""The training loop: megatron-core's pipeline schedule, DDP, optimizer, LR schedule, logging."""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import (OptimizerConfig, ParamKey, ParamPredicate, get_megatron_optimizer,
                                     get_standard_config_overrides)
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
from megatron.core.pipeline_parallel import get_forward_backward_func

from omnibal_ext.data.metrics import step_balance
from omnibal_ext.model.units import build_units

from megatron.vlm.layers.head import HeadOutput
from megatron.vlm.layers.layer_impl import resolve_layer_impl
from megatron.vlm.parallel.tied import build_tied_embedding_group
from megatron.vlm.stage.micro_batch import MicroBatch
from megatron.vlm.stage.build import StageBuild, build_stage
from omnibal_ext.model.spec import PROJECTOR, TEXT_EMBED, VISION_EMBED, VISION_LAYER

from . import checkpointing
from .interleaved import chunk_data, interleaved_peak, schedule_groups, sum_tied_grads
from .eval_generate import GenerationEval
from .finite_check import grad_buffers, local_flags, stop_if_nonfinite
from .loss_reduction import prefetch, weight
from .lr_schedule import ResumeRule, Schedule
from .memory import ActivationMeter, one_f_one_b_peak, static_bytes
from .moe_log import moe_log_of
from .metrics import (BalanceMeans, DataWait, MetricGroups, MetricsLog, StepResult, batch_balance,
                      random_batch_balance, reduce_reports, sample_ids, step_metrics)
from .config import OptimConfig
from .run_plan import RunPlan


def build_model(plan: RunPlan, img_context_id: int, device: torch.device):
    """This rank's pipeline stages of ``plan.layout``, one per model chunk (interleaved pipeline: layout stages
    rank, rank + PP, ...), each with its ``plan.recompute`` and wrapped in megatron's DistributedDataParallel."""
    model, parallel = plan.config.model, plan.config.parallel
    spec, tp, pp = plan.model_spec, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    layout, vpp, cp = plan.layout, parallel.virtual_pipeline_size, parallel.context_parallel_size
    on_cpu = device.type == "cpu"
    dtype = plan.config.optim.params_dtype
    rank = parallel_state.get_pipeline_model_parallel_rank()
    impl = resolve_layer_impl(model.transformer_impl, model.attention_backend, device, cp,
                              torch_layers_only=parallel.sequence_parallel or model.lora.on)
    modules = []
    for stage in plan.rank_stages(rank, pp):
        module = build_stage(StageBuild(
            spec, layout.stage_range(stage), tp=tp, pp=pp, dtype=dtype,
            impl=impl, seed=plan.config.optim.seed, recompute=plan.recompute[stage],
            img_context_id=img_context_id, on_cpu=on_cpu, sequence_parallel=parallel.sequence_parallel,
            cp=cp, trainable=model.trainable.trains,
            vision_drop_path_rate=model.vision_drop_path_rate, lora=model.lora, moe_run=model.moe_run))
        if vpp > 1:  # read by megatron-core's interleaved schedule and p2p communicator (model[0]'s config)
            module.config.virtual_pipeline_model_parallel_size = vpp
        module.to(device=device, dtype=dtype)
        modules.append(module)
    if spec.language.tie_word_embeddings:
        units = build_units(spec)
        embed_index = next(u.index for u in units if u.code == TEXT_EMBED)
        embed_rank = next(s for s in range(layout.num_stages) if embed_index in layout.stage_range(s)) % pp
        if embed_rank != pp - 1:  # every rank takes part in making the groups
            group = build_tied_embedding_group(embed_rank, pp - 1, timeout=parallel.timeout)
            for module in modules:
                module.tied_group = group
    # bucket_size left at megatron-core's default (40M parameters or 1M x DP, one bucket without overlap);
    # no align_param_gather (that is for the interleaved schedule): the DDP forward pre-hooks dispatch and
    # wait for each bucket's all-gather in the next forward
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=plan.overlap_grad_reduce,
        overlap_param_gather=plan.overlap_param_gather,
        use_distributed_optimizer=parallel.use_distributed_optimizer)
    return [DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module) for module in modules]


def finalize_grads(model, num_tokens=None, **kwargs):
    """megatron-core's finalize_model_grads, after summing the tied embedding's gradients across the
    stages that hold E and L (interleaved.sum_tied_grads, megatron/vlm/parallel/tied.py)."""
    sum_tied_grads([unwrap_model(chunk) for chunk in model])
    return finalize_model_grads(model, num_tokens, **kwargs)


GROUP_TAGS = {"vision_lr": 2.0, "projector_lr": 3.0}  # the lr_mult of the groups of their own LR (lr_overrides)


def lr_overrides(optim: OptimConfig, config: OptimizerConfig) -> dict:
    """megatron-core's param-group overrides: its standard ones (no weight decay on biases and norms) plus the
    peak (``max_lr``) and minimum (``min_lr``, scaled by the same ratio to --lr) of the ViT's (--vision-lr)
    and the projector's (--projector-lr) parameters, matched by the role the stage tags them with
    (``vlm_role``). The scheduler applies its warm-up and decay to each group between its own min and max.

    Such a group's ``lr_mult`` is its tag (``GROUP_TAGS``), not a multiplier: megatron-core 0.16 reads ``lr_mult``
    only to match a checkpoint's parameter groups to this run's (with ``wd_mult``, ``is_expert_parallel`` and
    ``is_decoupled_lr``); with megatron-core's default 1.0 the ViT's groups and the --lr groups matched each other
    and a resume failed."""
    overrides = get_standard_config_overrides(config)
    for name, lr, roles in (("vision_lr", optim.vision_lr, (VISION_EMBED, VISION_LAYER)),
                            ("projector_lr", optim.projector_lr, (PROJECTOR,))):
        if lr is None:
            continue
        min_lr = optim.min_lr * lr / optim.lr if optim.lr else optim.min_lr
        key = ParamKey(predicate=ParamPredicate(name=name, fn=lambda p, roles=roles: getattr(p, "vlm_role", None) in roles))
        overrides[key] = {"max_lr": lr, "min_lr": min_lr, "lr_mult": GROUP_TAGS[name]}
    return overrides


def build_optimizer(plan: RunPlan, model):
    """megatron-core's Adam over ``model``'s chunks (--lr, --vision-lr, --projector-lr, --weight-decay, --clip-grad,
    --adam-beta*) and its LR schedule (--lr-warmup-iters, --lr-decay-style over --train-iters, in samples)."""
    optim = plan.config.optim
    config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, clip_grad=optim.clip_grad,
        bf16=optim.bf16, params_dtype=optim.params_dtype,
        use_distributed_optimizer=plan.config.parallel.use_distributed_optimizer,
        overlap_param_gather=plan.overlap_param_gather)
    optimizer = get_megatron_optimizer(config, model, config_overrides=lr_overrides(optim, config))
    schedule = Schedule.from_flags(optim.lr, optim.min_lr, optim.lr_warmup_iters,
                                   optim.lr_decay_iters or optim.train_iters, optim.lr_decay_style,
                                   optim.weight_decay, optim.global_batch_size)
    rule = ResumeRule.of(optim.override_opt_param_scheduler, optim.use_checkpoint_opt_param_scheduler)
    return optimizer, schedule.scheduler(optimizer, rule)


def sync_params(model) -> None:
    """With --overlap-param-gather the updated parameters are all-gathered only by the next forward's
    pre-hooks: gather them now (before evaluation, a checkpoint or the end of training), as
    megatron's training loop does by disabling and re-enabling the hooks."""
    for m in model:
        if getattr(m, "use_forward_hook", False):
            m.disable_forward_pre_hook(param_sync=True)
            m.enable_forward_pre_hook()


def loss_func(batch: MicroBatch, token_correct: torch.Tensor, output_tensor: torch.Tensor, reduction: str = "token",
              scale: float | None = None):
    """The micro-batch's loss for the schedule, and what the log reports (megatron/training/loss_reduction.py).

    Returns megatron-core's (loss, count, report); the configs set ``calculate_per_token_loss``, so the schedule
    sums the losses and ``finalize_model_grads`` divides the gradients by the counts summed over the
    micro-batches and the data-parallel ranks.  token: (answer-token loss sum, answer tokens), megatron's
    per-token loss.  sample/square: (sum_s w(n_s) sum_{i in s} l_i x ``scale``, 1), with ``scale`` = (micro-batches
    x data-parallel ranks) / D, D the global batch's normaliser: the division by the counts then leaves
    sum / D.  report: {"lm loss": [weighted sum, sum_s w(n_s) n_s], "token loss": [loss sum, answer tokens],
    "answers": [correct, total]}.  An answer counts as correct when every one of its tokens is the argmax under
    teacher forcing (exactly when greedy decoding reproduces it).  The weights come from the host's
    ``sample_answers``: nothing here reads a device value.
    """
    labels = batch.text.labels
    mask = labels != -100
    token_losses = (output_tensor * mask).flatten()
    loss_sum = token_losses.sum()
    num_tokens = mask.sum().to(torch.int)
    seg = batch.packing.segment_ids.clamp(min=0).flatten()
    counts = batch.samples.sample_answers  # host list: n_s per sample
    n_samples = len(counts)
    dev = labels.device
    # per-sample sums over every token, weighted by the answer mask: no data-dependent shape (no sync)
    wrong = torch.zeros(n_samples, device=dev).index_add_(0, seg, ((~token_correct) & mask).flatten().float())
    if parallel_state.get_context_parallel_world_size() > 1:  # a sample's tokens are spread over the CP ranks
        dist.all_reduce(wrong, group=parallel_state.get_context_parallel_group())
    answered = torch.tensor([n > 0 for n in counts]).to(dev, non_blocking=True)  # whole samples' answer counts
    report = {
        "token loss": torch.stack([loss_sum.detach().clone().float(), num_tokens.float()]),
        "answers": torch.stack([(answered & (wrong == 0)).sum().float(), answered.sum().float()]),
    }
    # context parallelism: a sample's answer and its count (host metadata of the whole sample) are reported by
    # CP rank 0 alone (reports sum over DP x CP); each rank's loss sum holds its own tokens
    first_cp = parallel_state.get_context_parallel_rank() == 0
    if not first_cp:
        report["answers"] = torch.zeros_like(report["answers"])
    if reduction == "token":
        report["lm loss"] = report["token loss"]
        return loss_sum, num_tokens, report
    weights = [weight(int(n), reduction) for n in counts]
    per_sample = torch.zeros(n_samples, device=dev, dtype=token_losses.dtype).index_add_(0, seg, token_losses)
    weighted = (per_sample * torch.tensor(weights, dtype=token_losses.dtype).to(dev, non_blocking=True)).sum()
    norm = sum(w * n for w, n in zip(weights, counts)) if first_cp else 0.0
    report["lm loss"] = torch.stack([weighted.detach().clone().float(), torch.tensor(norm, device=dev).float()])
    one = torch.ones((), dtype=torch.int, device=dev)
    return (weighted if scale is None else weighted * scale), one, report


def forward_step(data_iterator, model, meter: ActivationMeter | None = None, reduction: str = "token",
                 scale: float | None = None):
    """megatron-core's forward_step_func (``partial(forward_step, meter=...)``): one micro-batch through
    this stage.  The last stage returns ``HeadOutput(loss, correct)``: the per-token loss and the argmax
    check go to ``loss_func`` (with ``reduction`` and ``scale``, see there).  meter: measures the bytes
    autograd saves (training forwards only)."""
    device = next(unwrap_model(model).parameters()).device
    raw = next(data_iterator)
    batch = raw.to(device, non_blocking=True)  # the loader's batches are on the host (or the device); cu_seqlens stay
    if meter is not None and torch.is_grad_enabled():
        with meter.measure():
            output = model(batch)
    else:
        output = model(batch)
    if isinstance(output, HeadOutput):
        return output.loss, partial(loss_func, batch, output.correct, reduction=reduction, scale=scale)
    return output, partial(loss_func, batch, None, reduction=reduction, scale=scale)


class ForwardBackward(Protocol):
    """megatron-core's pipeline schedule (``get_forward_backward_func()``; the interleaved one with our groups bound):
    runs ``num_microbatches`` forward (and backward) steps over ``model``'s chunks, returns the loss reports."""

    def __call__(self, *, forward_step_func: Callable, data_iterator, model: list, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, forward_only: bool) -> list[dict]: ...


@dataclass(frozen=True)
class StepSetup:
    """What every step of a run uses: megatron-core's schedule (``forward_backward``, with the interleaved one's
    groups), the activation meter (--log-activation-memory, else None), the metric groups, whether this rank
    holds the last pipeline stage and whether each step checks its loss and gradients for NaN/Inf
    (finite_check.py; --no-check-for-nan-in-loss-and-grad turns it off)."""
    forward_backward: ForwardBackward
    meter: ActivationMeter | None
    groups: MetricGroups
    is_last: bool
    check_finite: bool

    @classmethod
    def build(cls, plan: RunPlan, model) -> "StepSetup":
        """Also points the model's config at our DDP no-sync and gradient finalisation (read by the schedule)."""
        config = unwrap_model(model[0]).config
        config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]
        config.finalize_model_grads_func = finalize_grads
        forward_backward = get_forward_backward_func()
        if len(model) > 1:  # interleaved: megatron-core's schedule with our p2p shape exchange (interleaved.py)
            forward_backward = partial(forward_backward, **schedule_groups(config))
        meter = ActivationMeter(torch.nn.ModuleList([unwrap_model(m) for m in model])) \
            if plan.config.log.log_activation_memory else None
        return cls(forward_backward, meter, MetricGroups.build(plan.config.parallel.timeout),
                   parallel_state.is_pipeline_last_stage(), plan.config.optim.check_for_nan_in_loss_and_grad)


def activation_peak(meter: ActivationMeter, chunks: int, pp: int) -> int:
    """This rank's activation peak of the step the meter measured, in its schedule's order (bytes)."""
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return one_f_one_b_peak(meter.per_microbatch, rank, pp) if chunks == 1 else \
        interleaved_peak(meter.per_microbatch, rank, pp, chunks)


def train_step(plan: RunPlan, setup: StepSetup, model, optimizer, scheduler, train_data,
               iteration: int) -> StepResult:
    """Iteration ``iteration``: the global batch's micro-batches through the schedule, the optimizer and
    LR-scheduler steps."""
    start = time.perf_counter()
    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    if setup.meter:
        setup.meter.reset()
    train_data.start_recording()
    train_data.iteration = iteration  # the drop path's key
    wait = DataWait()
    data_iterator, scale = wait.timed(train_data), None
    optim = plan.config.optim
    reduction = optim.loss_reduction
    if setup.is_last and reduction != "token":  # the global batch's normaliser before the step (loss_reduction.py)
        with wait.timing():
            batches, norm = prefetch(train_data, optim.num_microbatches, reduction, setup.groups.dp_gloo)
        data_iterator = wait.timed(iter(batches))
        # the ranks whose loss counts finalize_model_grads sums (context-parallel ranks share their samples)
        dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        scale = optim.num_microbatches * dp_cp / max(norm, 1e-30)
    reports = setup.forward_backward(
        forward_step_func=partial(forward_step, meter=setup.meter, reduction=reduction, scale=scale),
        data_iterator=chunk_data(data_iterator, len(model)), model=model,
        num_microbatches=optim.num_microbatches, seq_length=plan.config.data.seq_length,
        micro_batch_size=optim.micro_batch_size, forward_only=False)
    if setup.check_finite:  # before the step: megatron-core's grad norm is computed inside it (finite_check.py)
        stop_if_nonfinite(iteration, *local_flags(reports, grad_buffers(model)), setup.groups.world_gloo)
    learning_rate = applied_lr(optimizer)
    _, grad_norm, _ = optimizer.step()
    records = train_data.stop_recording()
    pp = plan.config.parallel.pipeline_model_parallel_size
    peak = activation_peak(setup.meter, len(model), pp) if setup.meter else 0
    scheduler.step(increment=optim.global_batch_size)  # the next iteration's LR
    return StepResult(reports=reports, grad_norm=None if grad_norm is None else float(grad_norm),
                      learning_rate=learning_rate, records=records, data_wait_s=wait.seconds,
                      elapsed_s=time.perf_counter() - start, act_peak_bytes=peak)


def applied_lr(optimizer) -> float:
    """The LR the next optimizer step applies to the --lr parameter groups (megatron-core's ``default_config``
    groups; the first group when a rank holds none)."""
    groups = optimizer.param_groups
    lr = get_canonical_lr_for_logging(groups)
    return float(groups[0]["lr"] if lr is None else lr)


def due(interval: int | None, iteration: int, last: int) -> bool:
    """Whether an every-``interval`` action (0 or None: never) runs after ``iteration`` (always after ``last``)."""
    return bool(interval) and (iteration % interval == 0 or iteration == last)


def save(plan: RunPlan, iteration: int, consumed_samples: int, model, optimizer, scheduler, train_data) -> None:
    """The checkpoint of ``iteration``, the parameters gathered first (--overlap-param-gather)."""
    sync_params(model)
    checkpointing.save_checkpoint(plan, iteration, consumed_samples, model, optimizer, scheduler, train_data)


def train(plan: RunPlan, model, optimizer, scheduler, train_data, valid_data=None, start_iteration: int = 0,
          consumed_samples: int = 0, balance_fn=step_balance, sample_times=None) -> dict:
    """Run iterations start_iteration+1 .. train_iters; returns a summary for the caller.

    sample_times: (ViT, LLM) predicted time of every training sample (``isf.run_sample_times``), or None: the
    logged Dist ratios in time too."""
    optim, log_config, ckpt = plan.config.optim, plan.config.log, plan.config.checkpoint
    setup = StepSetup.build(plan, model)
    log = MetricsLog(log_config)
    generation = None  # --eval-generate (megatron/training/eval_generate.py)
    if log_config.eval_generate and valid_data is not None:
        generation = GenerationEval.build(plan, model, valid_data, setup.groups.dp_gloo)
    moe_log = moe_log_of(plan, [unwrap_model(m) for m in model], next(model[0].parameters()).device)
    history, balance_means, peak_act = [], BalanceMeans(), 0
    random_means, random_rng = BalanceMeans(), np.random.default_rng(optim.seed)  # Megatron's batching, same samples
    iteration, saved = start_iteration, None
    if start_iteration >= optim.train_iters and dist.get_rank() == 0:
        print(f"> nothing to train: the run starts at iteration {start_iteration} and --train-iters is "
              f"{optim.train_iters}" + (f" (the checkpoint is saved to --save {ckpt.save} as it is)" if ckpt.save
                                        else ""), flush=True)
    while iteration < optim.train_iters:
        checkpointing.fault_point("train", iteration + 1)
        if moe_log:
            moe_log.start_iteration()
        step = train_step(plan, setup, model, optimizer, scheduler, train_data, iteration + 1)
        iteration += 1
        peak_act = max(peak_act, step.act_peak_bytes)
        metrics = step_metrics(step, setup.groups, consumed_samples, setup.is_last)
        consumed_samples = metrics["consumed samples"]
        balance = batch_balance(step.records, balance_fn, setup.groups.dp_gloo, sample_times) if balance_fn else {}
        balance_means.add(balance)
        if balance_fn:
            random_means.add(random_batch_balance(step.records, setup.groups.dp_gloo, random_rng))
        metrics.update({k.replace("_", " "): v for k, v in balance.items()})
        if log_config.log_sample_ids:
            metrics["sample ids"] = sample_ids(step.records, setup.groups.dp_gloo)
        if moe_log:  # moe aux loss, expert load imbalance (megatron/training/moe_log.py)
            metrics.update(moe_log.metrics(iteration, setup.groups.world_gloo))
        if due(log_config.log_interval, iteration, optim.train_iters):
            log.log(iteration, optim.train_iters, metrics)
        if valid_data is not None and due(log_config.eval_interval, iteration, optim.train_iters):
            sync_params(model)
            if generation is not None:
                valid_data.start_recording()
            ev = evaluate(plan, model, valid_data, setup.forward_backward)
            if generation is not None:
                ev.update(generation.evaluate(valid_data.stop_recording()))
            if ev:
                log.log(iteration, optim.train_iters, ev, prefix="validation ")
                metrics.update({f"validation {k}": v for k, v in ev.items()})
        history.append(metrics)
        if ckpt.save and ckpt.save_interval and iteration % ckpt.save_interval == 0:
            save(plan, iteration, consumed_samples, model, optimizer, scheduler, train_data)
            saved = iteration
        if optim.exit_interval and iteration == optim.exit_interval:
            break
    sync_params(model)
    if ckpt.save and saved != iteration:  # the end of training (or a resume with nothing left: a resharded copy)
        save(plan, iteration, consumed_samples, model, optimizer, scheduler, train_data)
    summary = {"iterations": iteration, "consumed_samples": consumed_samples, "history": history}
    if setup.meter:
        summary["memory"] = stage_memory_report(plan, model, optimizer, peak_act)
        log.log(iteration, optim.train_iters, summary["memory"], prefix="memory ")
    balance = balance_means.means()
    if balance:
        summary["balance"] = balance
        summary["balance_random"] = random_means.means()
        log.log(iteration, optim.train_iters, {k.replace("_", " "): v for k, v in balance.items()},
                prefix="balance over the run, ")
    log.close()
    if moe_log:
        moe_log.close()
    return summary


def stage_memory_report(plan: RunPlan, model, optimizer, peak_act: int) -> dict:
    """Measured per-stage memory (the largest over the stage's ranks), and the plan's prediction."""
    device = next(unwrap_model(model[0]).parameters()).device
    allocated = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    mine = (parallel_state.get_pipeline_model_parallel_rank(), peak_act, static_bytes(model, optimizer), allocated,
            [u.name for m in model for u in unwrap_model(m).units])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    pp = plan.config.parallel.pipeline_model_parallel_size
    act = [max(e[1] for e in everyone if e[0] == stage) for stage in range(pp)]
    static = [max(e[2] for e in everyone if e[0] == stage) for stage in range(pp)]
    report = {"peak_act_bytes_per_stage": act, "static_bytes_per_stage": static}
    if len(model) > 1:  # interleaved: each rank's layout stages (its chunks) and the units they hold
        report["layout_stages_per_rank"] = [plan.rank_stages(r, pp) for r in range(pp)]
        report["units_per_rank"] = [next(e[4] for e in everyone if e[0] == stage) for stage in range(pp)]
    if allocated is not None:  # torch.cuda.max_memory_allocated over the run (CUDA only)
        report["max_allocated_bytes_per_stage"] = [max(e[3] for e in everyone if e[0] == stage) for stage in range(pp)]
    predicted = plan.adaptive_recompute
    if predicted is not None:
        report["predicted_peak_bytes_per_stage"] = list(predicted.stage_peak_bytes)
        report["predicted_static_bytes_per_stage"] = list(predicted.stage_static_bytes)
        report["budget_bytes"] = predicted.budget_bytes[0] if predicted.budget_bytes else None
    return report


def evaluate(plan: RunPlan, model, valid_data, forward_backward) -> dict:
    """The validation loss, token-mean loss and answer accuracy over --eval-iters global batches of ``valid_data``
    (default: one pass), on the last pipeline stage (others: {})."""
    optim = plan.config.optim
    for m in model:
        m.eval()
    reports = []
    valid_data.reset()
    iters = plan.config.log.eval_iters or valid_data.iterations_per_pass()
    with torch.no_grad():
        for _ in range(iters):
            reports += forward_backward(
                forward_step_func=partial(forward_step, reduction=optim.loss_reduction),
                data_iterator=chunk_data(valid_data, len(model)), model=model,
                num_microbatches=optim.num_microbatches, seq_length=plan.config.data.seq_length,
                micro_batch_size=optim.micro_batch_size, forward_only=True)
    for m in model:
        m.train()
    if not parallel_state.is_pipeline_last_stage():
        return {}
    totals = reduce_reports(reports, parallel_state.get_data_parallel_group(with_context_parallel=True))
    return {"lm loss": float(totals["lm loss"][0] / totals["lm loss"][1].clamp(min=1)),
            "token mean loss": float(totals["token loss"][0] / totals["token loss"][1].clamp(min=1)),
            "answer acc": float(totals["answers"][0] / totals["answers"][1].clamp(min=1)),
            "answers": int(totals["answers"][1])}
