"""Everything that can be wrong with the flags, checked before any process group, model or data is built:
:func:`validate_flags` raises an ``ArgumentError`` naming the flag."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os

from omnibal_ext.errors import UserError
from omnibal_ext.model.lora import Lora
from omnibal_ext.model.moe import ExpertGrid, expert_grid_problem
from omnibal_ext.model.trainable import trainable_of
from omnibal_ext.model.units import ModelSpec, build_units, family_of
from omnibal_ext.plan import tp_problem

from megatron.vlm.stage.components import runtime_family

from .energon_data import check_energon_flags
from .flags import MOE_FLAGS, ArgumentError, build_parser, dest_of, given_flags
from .specs import batch_sizes, data_parallel_size, media_overrides, model_spec_of, virtual_pipeline_size


def check_moe(flags, spec: ModelSpec, tp: int, pp: int, cp: int, dp: int) -> None:
    """The MoE flags against each other and megatron-core's expert grid (naming the flag)."""
    moe = spec.language.moe
    if moe is None:
        if getattr(flags, "hf_checkpoint", None):  # a dense checkpoint: no MoE flag applies
            given = given_flags(flags, ("--num-experts", *MOE_FLAGS))
            if given:
                raise ArgumentError(f"{', '.join(given)} with --hf-checkpoint {flags.hf_checkpoint}: its LLM is dense "
                                    "(config.json names no experts); drop them")
        return
    if flags.moe_router_pre_softmax and flags.moe_router_score_function != "softmax":
        raise ArgumentError("--moe-router-pre-softmax is the softmax router's (the sigmoid router always "
                            "renormalises its top-k scores): drop it or use --moe-router-score-function softmax")
    if flags.moe_router_enable_expert_bias and flags.moe_router_score_function != "sigmoid":
        raise ArgumentError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                            "(megatron-core's aux-loss-free balancing)")
    if flags.moe_router_enable_expert_bias and flags.freeze_llm:
        raise ArgumentError("--moe-router-enable-expert-bias with --freeze-llm: the expert bias is the router's "
                            "state, which a frozen LLM keeps, but megatron-core updates it every step; drop one")
    if flags.moe_aux_loss_coeff < 0 or (flags.moe_z_loss_coeff is not None and flags.moe_z_loss_coeff < 0):
        raise ArgumentError("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
    lora = Lora.from_args(flags)
    mlp = [t for t in lora.targets if t in ("llm.fc1", "llm.fc2")] if lora.on else []
    if mlp:
        raise ArgumentError(f"--lora-targets {','.join(mlp)} (the default targets include them) with --num-experts: "
                            "adapters on experts (llm.experts) are not supported yet; give --lora-targets "
                            "llm.qkv,llm.proj (and ViT targets)")
    if tp > 1 and not flags.sequence_parallel:
        raise ArgumentError(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                            "(megatron-core's MoELayer refuses to train under TP without it)")
    if flags.transformer_impl == "transformer_engine":
        raise ArgumentError("--num-experts runs megatron-core's local MoE (SequentialMLP): use --transformer-impl "
                            "local or auto")
    ep, etp = flags.expert_model_parallel_size, flags.expert_tensor_parallel_size or tp
    if ep < 1 or etp < 1:
        raise ArgumentError("--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1")
    problem = expert_grid_problem(moe, ExpertGrid(ep, etp), tp, cp, dp)
    if problem:
        flag = "--expert-tensor-parallel-size" if problem.startswith(f"ETP {etp} does not divide the expert") \
            else "--expert-model-parallel-size"
        raise ArgumentError(f"{flag}: {problem} (--expert-model-parallel-size {ep}, --expert-tensor-parallel-size "
                            f"{etp}, world {tp * cp * dp * pp})")



# (flag, least value that can work; 0 turns an interval off): checked first, so that no division or loop
# of the run (all after the process groups start) meets them
_LOWER_BOUNDS = (
    ("--micro-batch-size", 1), ("--global-batch-size", 1), ("--train-iters", 0), ("--log-interval", 1),
    ("--eval-interval", 0), ("--eval-iters", 1), ("--save-interval", 0), ("--exit-interval", 0),
    ("--seq-length", 1), ("--max-num-tiles", 1), ("--min-num-tiles", 1), ("--num-workers", 0), ("--prefetch-factor", 1),
    ("--lr", 0), ("--min-lr", 0), ("--lr-warmup-iters", 0), ("--lr-decay-iters", 1), ("--weight-decay", 0),
    ("--clip-grad", 0), ("--adam-beta1", 0), ("--adam-beta2", 0), ("--max-skipped-fraction", 0),
    ("--omnibal-isf-qv", 1), ("--omnibal-isf-qt", 1), ("--omnibal-isf-qv-min", 0), ("--omnibal-isf-qt-min", 0),
    ("--omnibal-isf-token-multiple", 1), ("--omnibal-isf-iters", 1), ("--omnibal-isf-vit-time", 0),
    ("--omnibal-isf-llm-time", 1), ("--omnibal-isf-vit-time-min", 0), ("--omnibal-isf-llm-time-min", 0),
    ("--ckpt-step", 0), ("--keep-checkpoints", 1), ("--min-pixels", 1),
    ("--max-pixels", 1), ("--omnibal-isf-buffer", 1),
)
_ISF_VALUES = ("--omnibal-isf-qv", "--omnibal-isf-qt", "--omnibal-isf-qv-min", "--omnibal-isf-qt-min",
               "--omnibal-isf-token-multiple", "--omnibal-isf-iters", "--omnibal-isf-vit-time", "--omnibal-isf-llm-time",
               "--omnibal-isf-vit-time-min", "--omnibal-isf-llm-time-min", "--omnibal-isf-buffer",
               "--omnibal-isf-stats")


def _flag_value(flags, flag: str):
    return getattr(flags, dest_of(flag))


# (flag, bound it must stay below, or at most when the third entry is True)
_UPPER_BOUNDS = (("--adam-beta1", 1, False), ("--adam-beta2", 1, False), ("--max-skipped-fraction", 1, True))


def check_finite(flags, parser: argparse.ArgumentParser) -> None:
    """Every float flag given is a finite number (argparse's ``float`` takes "nan" and "inf")."""
    for action in parser._actions:
        value = getattr(flags, action.dest, None)
        if action.type is float and value is not None and not math.isfinite(value):
            raise ArgumentError(f"{action.option_strings[0]} {value}: must be a finite number")


def check_lower_bounds(flags) -> None:
    """Every flag of ``_LOWER_BOUNDS`` that is given is at least its bound, and below its ``_UPPER_BOUNDS``."""
    for flag, most, inclusive in _UPPER_BOUNDS:
        value = _flag_value(flags, flag)
        if value is not None and (value > most if inclusive else value >= most):
            raise ArgumentError(f"{flag} {value}: must be {'<=' if inclusive else '<'} {most}")
    for flag, least in _LOWER_BOUNDS:
        value = _flag_value(flags, flag)
        if value is not None and value < least:
            raise ArgumentError(f"{flag} {value}: must be >= {least}")
    if flags.min_num_tiles > flags.max_num_tiles:
        raise ArgumentError(f"--min-num-tiles {flags.min_num_tiles} > --max-num-tiles {flags.max_num_tiles}")


def check_isf_flags(flags) -> None:
    """--omnibal-isf-* need --omnibal-isf; the caps go together; each lower bound is at most its cap; the time
    thresholds need the count caps (their hard caps)."""
    given = [flag for flag in _ISF_VALUES if _flag_value(flags, flag) is not None]
    if given and not flags.omnibal_isf:
        raise ArgumentError(f"{' '.join(given)} given without --omnibal-isf: add --omnibal-isf or drop them")
    qv, qt = flags.omnibal_isf_qv, flags.omnibal_isf_qt
    if (qv is None) != (qt is None):
        raise ArgumentError("--omnibal-isf-qv and --omnibal-isf-qt go together (or give neither to search them)")
    vt, lt = flags.omnibal_isf_vit_time, flags.omnibal_isf_llm_time
    if (vt is None) != (lt is None):
        raise ArgumentError("--omnibal-isf-vit-time and --omnibal-isf-llm-time go together (or give neither to search "
                            "them)")
    if vt is not None and qv is None:
        raise ArgumentError("--omnibal-isf-vit-time/--omnibal-isf-llm-time need --omnibal-isf-qv/-qt (the hard count "
                            "caps the memory is planned for)")
    if flags.omnibal_isf_iters is not None and qv is None:
        raise ArgumentError("--omnibal-isf-iters needs fixed thresholds (--omnibal-isf-qv/-qt); a search tries its own")
    for low_flag, low, cap_flag, cap in (("--omnibal-isf-qv-min", flags.omnibal_isf_qv_min, "--omnibal-isf-qv", qv),
                                         ("--omnibal-isf-qt-min", flags.omnibal_isf_qt_min, "--omnibal-isf-qt", qt),
                                         ("--omnibal-isf-vit-time-min", flags.omnibal_isf_vit_time_min,
                                          "--omnibal-isf-vit-time", vt),
                                         ("--omnibal-isf-llm-time-min", flags.omnibal_isf_llm_time_min,
                                          "--omnibal-isf-llm-time", lt)):
        if low is not None and cap is None:
            raise ArgumentError(f"{low_flag} {low} needs {cap_flag} (a lower bound of a fixed cap)")
        if low is not None and low > cap:
            raise ArgumentError(f"{low_flag} {low} is above {cap_flag} {cap}: a lower bound must not exceed its cap")


def check_schedule_flags(flags) -> None:
    """The LR schedule's flags against each other (megatron-core's scheduler asserts them only after the data scan
    and the model build) and the two resume flags, which contradict each other."""
    if flags.lr < flags.min_lr:
        raise ArgumentError(f"--lr {flags.lr} is below --min-lr {flags.min_lr}: the schedule decays from --lr to "
                            f"--min-lr (give --min-lr {flags.lr} or less)")
    if flags.override_opt_param_scheduler and flags.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each "
                            "other: give one (this run's schedule flags, or the checkpoint's schedule)")
    for flag, given in (("--override-opt_param-scheduler", flags.override_opt_param_scheduler),
                        ("--use-checkpoint-opt_param-scheduler", flags.use_checkpoint_opt_param_scheduler)):
        if given and not flags.load:
            raise ArgumentError(f"{flag} needs --load (it says which LR schedule a resumed run follows)")


def check_run_safety_flags(flags, parser: argparse.ArgumentParser) -> None:
    """Flags that only act with another (refused alone rather than ignored), and --tensorboard-dir's package."""
    if flags.force_save_lock and not flags.save:
        raise ArgumentError("--force-save-lock needs --save (it takes over the --save folder's lock)")
    if flags.max_skipped_fraction != parser.get_default("max_skipped_fraction") and not flags.skip_bad_samples:
        raise ArgumentError("--max-skipped-fraction needs --skip-bad-samples (without it any bad record stops the run)")
    if flags.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:  # torch.utils.tensorboard's
        raise ArgumentError(f"--tensorboard-dir {flags.tensorboard_dir}: the tensorboard package is not installed "
                            "(pip install -e '.[tensorboard]', or drop the flag)")


def validate_flags(flags, world_size: int) -> None:
    """Check flags against each other and the world size; raise ArgumentError naming the flag."""
    parser = build_parser()
    check_finite(flags, parser)
    check_lower_bounds(flags)
    check_isf_flags(flags)
    check_schedule_flags(flags)
    check_run_safety_flags(flags, parser)
    if flags.log_sample_ids and not flags.json_log:
        raise ArgumentError("--log-sample-ids writes into the JSON lines of --json-log: give --json-log FILE")
    tp, pp = flags.tensor_model_parallel_size, flags.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ArgumentError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    spec = model_spec_of(flags)
    check_capabilities(flags, spec)  # first: a family's unit list refuses what it lacks (experts) less clearly
    n_units = len(build_units(spec))
    if pp > n_units:
        raise ArgumentError(
            f"--pipeline-model-parallel-size {pp} is larger than the model's {n_units} pipeline units "
            f"({spec.vision.num_layers} ViT layers + {spec.language.num_layers} LLM layers + embeddings, "
            f"projector and head): some stage would be empty")
    vpp = virtual_pipeline_size(flags)  # checks the flag against the layout (LayoutError names --pipeline-layout)
    if flags.transformer_impl == "transformer_engine" and flags.attention_backend == "unfused":
        raise ArgumentError("--attention-backend unfused is megatron-core's DotProductAttention (a torch "
                            "module): use --transformer-impl local or auto with it")
    if flags.sequence_parallel and (tp < 2 or flags.transformer_impl == "transformer_engine"
                                   or flags.attention_backend == "unfused"):
        raise ArgumentError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the tokens "
                            "over the TP ranks) and megatron-core's torch layers with --attention-backend auto")
    if not flags.distributed_timeout_minutes > 0:
        raise ArgumentError(f"--distributed-timeout-minutes {flags.distributed_timeout_minutes}: must be > 0")
    cp = flags.context_parallel_size
    if cp < 1:
        raise ArgumentError(f"--context-parallel-size {cp}: must be >= 1")
    if cp > 1 and flags.attention_backend == "unfused":
        raise ArgumentError("--context-parallel-size needs the packed-sequence attention (--attention-backend auto): "
                            "--attention-backend unfused is megatron-core's dense-mask DotProductAttention, which has "
                            "no context parallelism")
    if cp > 1 and flags.transformer_impl == "transformer_engine":
        raise ArgumentError("--context-parallel-size with --transformer-impl transformer_engine is not supported yet: "
                            "use --transformer-impl local (SegmentAttention's all-gather context parallelism)")
    if flags.overlap_param_gather and not flags.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer (it overlaps the "
                            "distributed optimizer's parameter all-gather)")
    dp = data_parallel_size(flags, world_size)
    v, lang = spec.vision, spec.language
    if lang.head_dim is not None and lang.head_dim < 1:
        raise ArgumentError(f"--head-dim {lang.head_dim}: must be >= 1")
    for name, heads, hidden in [("--vision-num-attention-heads", v.num_attention_heads, v.hidden_size),
                                ("--num-attention-heads", lang.num_attention_heads, lang.hidden_size)]:
        if hidden % heads and not (name == "--num-attention-heads" and lang.head_dim):
            raise ArgumentError(f"{name} {heads} does not divide the hidden size {hidden}")
    if tp_problem(spec, tp):  # the planner's rule: the LLM's heads and groups divide, the ViT's are padded
        flag, value, what = (("--num-attention-heads", lang.num_attention_heads, "LLM attention heads")
                             if lang.num_attention_heads % tp else
                             ("--num-query-groups", lang.kv_groups, "LLM key/value groups"))
        raise ArgumentError(f"{flag} {value} ({what}) is not divisible by --tensor-model-parallel-size {tp}: "
                            f"each TP rank needs a whole share of them")
    problem = family_of(spec).spec_problem(spec)
    if problem:
        raise ArgumentError(problem)
    check_moe(flags, spec, tp, pp, cp, dp)
    _, microbatches = batch_sizes(flags, dp)
    if vpp > 1:
        check_interleaving(vpp, pp, microbatches, n_units)
        if flags.omnibal_recompute == "auto":
            raise ArgumentError("--omnibal-recompute auto plans one model chunk per pipeline rank: it does not "
                                "support --virtual-pipeline-model-parallel-size > 1 (give --recompute-plan per stage)")
    if flags.recompute_granularity and flags.recompute_plan:
        raise ArgumentError("give either --recompute-granularity or --recompute-plan, not both")
    if flags.omnibal_recompute == "auto" and (flags.recompute_granularity or flags.recompute_plan):
        raise ArgumentError("--omnibal-recompute auto chooses the recompute itself: drop --recompute-*")
    if flags.omnibal_partition == "auto" and flags.pipeline_layout:
        raise ArgumentError("--omnibal-partition auto chooses the layout itself: drop --pipeline-layout")
    if flags.save_interval and not flags.save:
        raise ArgumentError("--save-interval needs --save")
    check_eval_generate(flags, vpp)
    if not 0.0 <= flags.vision_drop_path_rate < 1.0:
        raise ArgumentError(f"--vision-drop-path-rate {flags.vision_drop_path_rate}: must be in [0, 1)")
    if flags.load and os.path.isfile(flags.load):
        raise ArgumentError(f"--load {flags.load} is a file: give the checkpoint folder (the one holding "
                            "latest_checkpointed_iteration.txt and iter_N/)")
    if flags.ckpt_step is not None and not flags.load:
        raise ArgumentError("--ckpt-step needs --load")
    trainable_of(flags, spec)  # FreezeError/LoraError: flags that do not fit together or freeze everything
    check_lora(flags, spec, tp)
    for flag, value in (("--vision-lr", flags.vision_lr), ("--projector-lr", flags.projector_lr)):
        if value is not None and value < 0:
            raise ArgumentError(f"{flag} {value}: must be >= 0")
    check_energon_flags(flags)  # the Energon path's flags, or their refusal without it


def check_eval_generate(flags, vpp: int) -> None:
    """--eval-generate runs generation on the training stages: one per rank, whose attention keeps a KV cache."""
    if flags.eval_generate_samples is not None and (flags.eval_generate_samples < 1 or not flags.eval_generate):
        raise ArgumentError(f"--eval-generate-samples {flags.eval_generate_samples}: must be >= 1, with --eval-generate")
    if not flags.eval_generate:
        return
    if not flags.eval_interval:
        raise ArgumentError("--eval-generate runs at each evaluation: give --eval-interval > 0")
    refused = [(flags.context_parallel_size > 1, f"--context-parallel-size {flags.context_parallel_size}"),
               (vpp > 1, "an interleaved pipeline (several model chunks per rank)"),
               (flags.transformer_impl == "transformer_engine", "--transformer-impl transformer_engine"),
               (flags.attention_backend == "unfused", "--attention-backend unfused")]
    for bad, what in refused:
        if bad:
            raise ArgumentError(f"--eval-generate with {what}: generation runs one stage per pipeline rank, its "
                                "attention megatron-core's torch layers with the packed-sequence attention (the one "
                                "that keeps a KV cache)")


# ``Capabilities`` field -> (flag, whether the flags ask for it): a family that does not declare the field refuses
# the flag (``check_capabilities``). Fields without a flag yet (no flag asks for them): ``UNFLAGGED_CAPABILITIES``.
CAPABILITY_FLAGS = {
    "drop_path": ("--vision-drop-path-rate", lambda flags: flags.vision_drop_path_rate > 0),
    "context_parallel": ("--context-parallel-size", lambda flags: flags.context_parallel_size > 1),
    "sequence_parallel": ("--sequence-parallel", lambda flags: bool(flags.sequence_parallel)),
    "moe": ("--num-experts", lambda flags: getattr(flags, "num_experts", None) is not None),
    "video": ("--video-*", lambda flags: bool(video_flags_given(flags))),
}
UNFLAGGED_CAPABILITIES = ()
IMAGE_FLAGS = ("--max-num-tiles", "--min-num-tiles", "--min-pixels", "--max-pixels")  # read by some image rules


def video_flags_given(flags) -> tuple[str, ...]:
    """The ``--video-*`` flags given (``VideoOverrides.given``)."""
    return media_overrides(flags).video.given()


def check_video_flags(flags, spec: ModelSpec) -> None:
    """The family's video rule built from the flags (``DataSide.video_rule``): a flag its processor does not
    implement, or settings that do not fit together, are refused now, naming the flag."""
    rule = runtime_family(spec).data.video_rule
    if rule is None:
        raise ArgumentError(f"{', '.join(video_flags_given(flags))}: model family {spec.family} declares video but "
                            "its data side has no video rule")
    try:
        rule(media_overrides(flags), spec, flags.hf_checkpoint)
    except UserError as e:
        raise ArgumentError(str(e)) from None


def check_capabilities(flags, spec: ModelSpec) -> None:
    """Refuse a flag that asks for what ``spec``'s family does not declare (``Family.capabilities``), naming the
    family and the flag: a flag is honoured or refused, never ignored."""
    caps = family_of(spec).capabilities
    who = f"model family {spec.family}"
    for field, (flag, asked) in CAPABILITY_FLAGS.items():
        if asked(flags) and not getattr(caps, field):
            if field == "video":
                flag = ", ".join(video_flags_given(flags))
            raise ArgumentError(f"{flag}: {who} does not implement it (Capabilities.{field}); drop the flag")
    if caps.video and video_flags_given(flags):
        check_video_flags(flags, spec)
    lora = Lora.from_args(flags)
    if lora.on:
        bad = [t for t in lora.targets if t not in caps.lora_targets]
        if bad:
            raise ArgumentError(f"--lora-targets {','.join(bad)}: {who} has no adapters there (it takes: "
                                f"{', '.join(caps.lora_targets) or 'none'})")
    for flag in given_flags(flags, IMAGE_FLAGS):
        if flag not in caps.image_flags:
            raise ArgumentError(f"{flag}: {who}'s image rule does not read it (it reads: "
                                f"{', '.join(caps.image_flags) or 'no image flag'}); drop the flag")


def check_lora(flags, spec: ModelSpec, tp: int) -> None:
    """LoRA runs on megatron-core's torch linears, and the ViT's attention adapters on unpadded heads."""
    lora = Lora.from_args(flags)
    if not lora.on:
        return
    if flags.transformer_impl == "transformer_engine":
        raise ArgumentError("--lora-rank with --transformer-impl transformer_engine is not supported (TE fuses the "
                            "norm into qkv/fc1): use --transformer-impl local or auto")
    padded = spec.vision.padded_heads(tp) != spec.vision.num_attention_heads
    attention = [t for t in lora.targets if t in ("vit.qkv", "vit.proj")]
    if padded and attention:
        raise ArgumentError(f"--lora-targets {','.join(attention)}: the ViT's {spec.vision.num_attention_heads} heads "
                            f"are padded at --tensor-model-parallel-size {tp}; adapters on padded heads are not "
                            "supported (pick a TP size that divides the heads, or adapt vit.fc1/vit.fc2 only)")



def check_interleaving(vpp: int, pp: int, microbatches: int, n_units: int | None = None) -> None:
    """megatron-core's interleaved schedule needs micro-batches per pipeline >= PP and a multiple of PP."""
    if microbatches < pp or microbatches % pp:
        raise ArgumentError(
            f"interleaved pipeline ({vpp} model chunks per rank): megatron-core's schedule needs the micro-batches per "
            f"pipeline ({microbatches} = --global-batch-size / (--micro-batch-size x data-parallel size)) to be at "
            f"least and a multiple of --pipeline-model-parallel-size {pp}")
    if n_units is not None and vpp * pp > n_units:
        raise ArgumentError(f"interleaved pipeline: {vpp} model chunks x --pipeline-model-parallel-size {pp} "
                            f"stages but the model has only {n_units} pipeline units")


