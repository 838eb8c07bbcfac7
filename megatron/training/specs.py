"""What the flags describe: the model spec (the preset with the model flags, or --hf-checkpoint's config.json),
its experts and how they train, the parallel and batch sizes, and the typed :class:`~megatron.training.config.RunConfig`
of the whole run (:func:`run_config`).

Each function reads the parsed flags (``flags``, an ``argparse.Namespace`` from ``flags.build_parser``); nothing
after ``arguments.parse_config`` does.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from omnibal_ext.data.isf import ISFParams
from omnibal_ext.errors import UserError
from omnibal_ext.model.cp_split import cp_multiple
from omnibal_ext.model.layout import parse_layout
from omnibal_ext.model.lora import Lora
from omnibal_ext.model.moe import MoESpec, parse_layer_freq
from omnibal_ext.model.spec import vit_layers_for_feature_layer
from omnibal_ext.model.trainable import trainable_of
from omnibal_ext.model.units import ModelSpec, get_preset

from megatron.vlm.data.images import MediaOverrides
from megatron.vlm.data.video_sampling import VideoOverrides
from megatron.vlm.hf.configs import read_config, spec_from_config
from megatron.vlm.layers.moe import MoERun

from .config import (BalanceConfig, CheckpointConfig, DataConfig, LogConfig, ModelConfig, OptimConfig, ParallelConfig,
                     RunConfig)
from .flags import DEFAULT_ISF_BUFFER, MOE_FLAGS, ArgumentError, build_parser, given_flags


def moe_spec_from_flags(flags, num_layers: int, ffn_hidden_size: int):
    """The experts the flags describe (``omnibal_ext.model.moe.MoESpec``), None without --num-experts; the MoE flags
    without --num-experts are refused, naming them."""
    if flags.num_experts is None:
        given = given_flags(flags, MOE_FLAGS)
        if given:
            raise ArgumentError(f"{', '.join(given)}: MoE flag(s) without --num-experts (a dense LLM); give "
                                "--num-experts or drop them")
        return None
    for flag, value in (("--num-experts", flags.num_experts), ("--moe-router-topk", flags.moe_router_topk),
                        ("--moe-ffn-hidden-size", flags.moe_ffn_hidden_size)):
        if value is not None and value < 1:
            raise ArgumentError(f"{flag} {value}: must be >= 1")
    if flags.moe_router_topk > flags.num_experts:
        raise ArgumentError(f"--moe-router-topk {flags.moe_router_topk} exceeds --num-experts {flags.num_experts}")
    try:
        freq = parse_layer_freq(flags.moe_layer_freq, num_layers)
        return MoESpec(num_experts=flags.num_experts, topk=flags.moe_router_topk,
                       ffn_hidden_size=flags.moe_ffn_hidden_size or ffn_hidden_size, layer_freq=freq,
                       shared_expert_ffn_hidden_size=flags.moe_shared_expert_intermediate_size or 0,
                       shared_expert_gate=flags.moe_shared_expert_gate,
                       norm_topk_prob=not flags.moe_router_pre_softmax, score_function=flags.moe_router_score_function,
                       load_balancing_type=flags.moe_router_load_balancing_type,
                       capacity_factor=flags.moe_expert_capacity_factor)
    except ArgumentError:
        raise
    except UserError as e:
        message = str(e)
        flag = "--moe-layer-freq" if "layer_freq" in message or "--moe-layer-freq" in message else "--num-experts"
        raise ArgumentError(message if message.startswith("--") else f"{flag}: {message}") from None



def moe_run_of(flags, spec: ModelSpec | None = None):
    """How the MoE layers train (``megatron.vlm.layers.moe.MoERun``) from checked flags; None for a dense model (``spec``,
    the model the flags describe: default ``model_spec_of(flags)``)."""
    spec = model_spec_of(flags) if spec is None else spec
    if spec.language.moe is None:
        return None
    return MoERun(aux_loss_coeff=flags.moe_aux_loss_coeff, z_loss_coeff=flags.moe_z_loss_coeff,
                  expert_bias=flags.moe_router_enable_expert_bias, bias_update_rate=flags.moe_router_bias_update_rate,
                  drop_policy=flags.moe_token_drop_policy, dispatcher=flags.moe_token_dispatcher_type,
                  ep=flags.expert_model_parallel_size,
                  etp=flags.expert_tensor_parallel_size or flags.tensor_model_parallel_size)


# dests of the flags that describe the model (besides --model)
MODEL_DESTS = ("vision_num_layers", "vision_hidden_size", "vision_num_attention_heads", "vision_ffn_hidden_size",
               "image_size", "patch_size", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "init_method_std", "vision_normalization", "vision_norm_eps", "vision_qkv_bias",
               "vision_qk_norm", "vision_layer_scale_init", "vision_feature_layer", "qkv_bias", "head_dim",
               "norm_epsilon", "rotary_base", "tie_word_embeddings")


def hf_spec_from_flags(flags) -> ModelSpec:
    """--hf-checkpoint: the model of DIR/config.json; model flags given besides must agree with it."""
    folder = flags.hf_checkpoint
    if not os.path.isdir(folder):
        raise ArgumentError(f"--hf-checkpoint {folder}: no such folder")
    spec, _ = spec_from_config(read_config(folder), "hf:" + os.path.basename(os.path.normpath(folder)),
                               os.path.join(folder, "config.json"))
    parser = build_parser()
    if flags.model != parser.get_default("model"):
        raise ArgumentError(f"--model {flags.model} and --hf-checkpoint {folder} both name a model: drop --model")
    given = [d for d in MODEL_DESTS if getattr(flags, d) != parser.get_default(d)]
    conflicts = []
    for d in given:
        if d == "vision_feature_layer":
            conflicts.append("--vision-feature-layer (config.json's vision_feature_layer applies)")
            continue
        probe = argparse.Namespace(**{k: parser.get_default(k) for k in MODEL_DESTS})
        setattr(probe, d, getattr(flags, d))
        if model_spec_from_flags(probe, base=spec) != spec:
            conflicts.append(f"--{d.replace('_', '-')} {getattr(flags, d)}")
    conflicts += hf_moe_conflicts(flags, spec.language.moe)
    if conflicts:
        raise ArgumentError(f"--hf-checkpoint {folder}: model flag(s) {', '.join(conflicts)} disagree with its "
                            "config.json; drop them (the model comes from the checkpoint)")
    if spec.language.moe is not None:  # what the checkpoint leaves to the run: the balancing loss, token dropping
        moe = dataclasses.replace(spec.language.moe, load_balancing_type=flags.moe_router_load_balancing_type,
                                  capacity_factor=flags.moe_expert_capacity_factor)
        spec = spec.replace(language=dataclasses.replace(spec.language, moe=moe))
    return spec


def hf_moe_conflicts(flags, moe) -> list[str]:
    """The MoE flags a checkpoint's config.json fixes (the experts, routing, MoE layers, shared expert) that were
    given and disagree with ``moe`` (its MoESpec; None: a dense LLM, refused by ``check_moe``)."""
    if moe is None or not hasattr(flags, "num_experts"):
        return []
    parser = build_parser()
    fixed = {"num_experts": moe.num_experts, "moe_router_topk": moe.topk, "moe_ffn_hidden_size": moe.ffn_hidden_size,
             "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size or None,
             "moe_shared_expert_gate": moe.shared_expert_gate, "moe_router_score_function": moe.score_function,
             "moe_router_pre_softmax": moe.score_function == "softmax" and not moe.norm_topk_prob}
    out = [f"--{d.replace('_', '-')} {getattr(flags, d)}" for d, want in fixed.items()
           if getattr(flags, d) != parser.get_default(d) and getattr(flags, d) != want]
    if flags.moe_layer_freq != parser.get_default("moe_layer_freq"):
        try:
            same = parse_layer_freq(flags.moe_layer_freq, len(moe.layer_freq)) == moe.layer_freq
        except UserError:
            same = False
        if not same:
            out.append(f"--moe-layer-freq {flags.moe_layer_freq}")
    return out


def model_spec_from_flags(flags, base: ModelSpec | None = None) -> ModelSpec:
    spec = base if base is not None else get_preset(flags.model)
    vision_dests = [
        ("num_layers", "vision_num_layers"), ("hidden_size", "vision_hidden_size"),
        ("num_attention_heads", "vision_num_attention_heads"), ("ffn_hidden_size", "vision_ffn_hidden_size"),
        ("image_size", "image_size"), ("patch_size", "patch_size"), ("normalization", "vision_normalization"),
        ("norm_eps", "vision_norm_eps"), ("qkv_bias", "vision_qkv_bias"), ("qk_norm", "vision_qk_norm"),
        ("layer_scale_init", "vision_layer_scale_init")]
    fields = {f.name for f in dataclasses.fields(spec.vision)}
    for key, dest in vision_dests:  # a ViT setting the family's ViT does not have: refused, not ignored
        if key not in fields and getattr(flags, dest, None) is not None:
            raise ArgumentError(f"--{dest.replace('_', '-')}: model family {spec.family}'s ViT "
                                f"({type(spec.vision).__name__}) has no {key!r} setting; drop the flag")
    v = {k: getattr(flags, a) for k, a in vision_dests[:6] if getattr(flags, a) is not None}
    lang = {k: getattr(flags, a) for k, a in [
        ("num_layers", "num_layers"), ("hidden_size", "hidden_size"),
        ("num_attention_heads", "num_attention_heads"), ("num_query_groups", "num_query_groups"),
        ("ffn_hidden_size", "ffn_hidden_size")] if getattr(flags, a) is not None}
    v.update({k: getattr(flags, a) for k, a in [
        ("normalization", "vision_normalization"), ("norm_eps", "vision_norm_eps"), ("qkv_bias", "vision_qkv_bias"),
        ("qk_norm", "vision_qk_norm")] if getattr(flags, a) is not None})
    scale = flags.vision_layer_scale_init
    if scale is not None:
        if scale.lower() == "none":
            v["layer_scale_init"] = None
        else:
            try:
                v["layer_scale_init"] = float(scale)
            except ValueError:
                raise ArgumentError(f"--vision-layer-scale-init {scale!r}: a number or 'none'") from None
    lang.update({k: getattr(flags, a) for k, a in [
        ("qkv_bias", "qkv_bias"), ("head_dim", "head_dim"), ("norm_eps", "norm_epsilon"),
        ("rotary_base", "rotary_base"), ("tie_word_embeddings", "tie_word_embeddings")]
        if getattr(flags, a) is not None})
    feature_layer = flags.vision_feature_layer
    if feature_layer != -1:
        n = v.get("num_layers", spec.vision.num_layers)
        try:
            v["num_layers"] = vit_layers_for_feature_layer(n, feature_layer)
        except UserError as e:
            raise ArgumentError(f"--vision-feature-layer: {e}") from None
    if hasattr(flags, "num_experts"):  # the MoE flags (a probe of hf_spec_from_flags has none)
        lang_now = dataclasses.replace(spec.language, **lang)
        moe = moe_spec_from_flags(flags, lang_now.num_layers, lang_now.ffn_hidden_size)
        if moe is not None:
            lang["moe"] = moe
    spec = spec.replace(vision=dataclasses.replace(spec.vision, **v), language=dataclasses.replace(spec.language, **lang))
    if flags.init_method_std is not None:
        spec = spec.replace(init_method_std=flags.init_method_std)
    return spec



def virtual_pipeline_size(flags) -> int:
    """Model chunks per pipeline rank (V): --virtual-pipeline-model-parallel-size, else --pipeline-layout's
    stages / PP (Megatron's convention), else 1.  Raises ArgumentError/LayoutError when they disagree."""
    pp, given = flags.pipeline_model_parallel_size, flags.virtual_pipeline_model_parallel_size
    if given is not None and given < 1:
        raise ArgumentError(f"--virtual-pipeline-model-parallel-size {given}: must be >= 1")
    vpp = given or 1
    if flags.pipeline_layout:
        vpp = parse_layout(flags.pipeline_layout, model_spec_of(flags), pp, vpp=given).num_stages // pp
    if vpp > 1 and pp < 2:
        raise ArgumentError(f"an interleaved pipeline ({vpp} model chunks per rank) needs "
                            "--pipeline-model-parallel-size >= 2")
    return vpp



def model_spec_of(flags) -> ModelSpec:
    """The model the flags describe: --hf-checkpoint's config.json, else the preset with the model flags
    (vocabulary not yet padded for the tokenizer)."""
    return hf_spec_from_flags(flags) if flags.hf_checkpoint else model_spec_from_flags(flags)


def data_parallel_size(flags, world_size: int) -> int:
    """world size / (TP x PP x CP); raises ArgumentError when it does not divide."""
    tp, pp = flags.tensor_model_parallel_size, flags.pipeline_model_parallel_size
    cp = flags.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ArgumentError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}" + (f" x --context-parallel-size {cp}" if cp > 1 else ""))
    return world_size // (tp * pp * cp)


def batch_sizes(flags, dp: int) -> tuple[int, int]:
    """(samples per iteration, micro-batches per iteration per data-parallel rank) for ``dp`` data-parallel
    ranks: --global-batch-size (default 4 micro-batches per rank) must be whole micro-batches on every rank."""
    mbs = flags.micro_batch_size
    global_batch = 4 * mbs * dp if flags.global_batch_size is None else flags.global_batch_size
    if global_batch % (mbs * dp):
        raise ArgumentError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size {mbs} x "
            f"data-parallel size {dp}")
    return global_batch, global_batch // (mbs * dp)


def isf_params_from_flags(flags) -> ISFParams | None:
    """Fixed thresholds from --omnibal-isf-qv/-qt[-min], --omnibal-isf-iters and the time thresholds
    --omnibal-isf-vit-time/-llm-time[-min] (lower bounds default to 90% of their caps), or None."""
    qv, qt = flags.omnibal_isf_qv, flags.omnibal_isf_qt
    if qv is None and qt is None:
        return None
    if qv is None or qt is None:
        raise ArgumentError("--omnibal-isf-qv and --omnibal-isf-qt go together (or give neither to search them)")

    def low(value, cap):
        return int(0.9 * cap) if value is None else value

    vt, lt = flags.omnibal_isf_vit_time, flags.omnibal_isf_llm_time
    timed = {} if vt is None else {"vit_time": vt, "llm_time": lt, "vit_time_min": low(flags.omnibal_isf_vit_time_min, vt),
                                   "llm_time_min": low(flags.omnibal_isf_llm_time_min, lt)}
    iters = {} if flags.omnibal_isf_iters is None else {"iters": flags.omnibal_isf_iters}
    try:
        return ISFParams(qv=qv, qt=qt, qv_min=low(flags.omnibal_isf_qv_min, qv), qt_min=low(flags.omnibal_isf_qt_min, qt),
                         **iters, **timed)
    except ValueError as e:
        raise ArgumentError(f"--omnibal-isf-*: {e}") from None


def isf_token_multiple(flags) -> int:
    """--omnibal-isf-token-multiple, else the multiple context parallelism pads every sample to (1 without CP)."""
    if flags.omnibal_isf_token_multiple is not None:
        return flags.omnibal_isf_token_multiple
    sp_tp = flags.tensor_model_parallel_size if flags.sequence_parallel else 1
    return cp_multiple(flags.context_parallel_size, sp_tp)


def media_overrides(flags) -> MediaOverrides:
    """The image and video flags the families' data sides read (``DataSide.image_rule``/``video_rule``)."""
    return MediaOverrides(max_num_tiles=flags.max_num_tiles, min_num_tiles=flags.min_num_tiles,
                          min_pixels=flags.min_pixels, max_pixels=flags.max_pixels,
                          video=VideoOverrides.from_args(flags))


def run_config(flags: argparse.Namespace, world_size: int) -> RunConfig:
    """The typed configuration of checked flags (``validation.validate_flags``) for ``world_size`` processes."""
    spec = model_spec_of(flags)
    tp = flags.tensor_model_parallel_size
    dp = data_parallel_size(flags, world_size)
    global_batch, microbatches = batch_sizes(flags, dp)
    model = ModelConfig(spec=spec, hf_checkpoint=flags.hf_checkpoint, trainable=trainable_of(flags, spec),
                        lora=Lora.from_args(flags), moe_run=moe_run_of(flags, spec),
                        transformer_impl=flags.transformer_impl, attention_backend=flags.attention_backend,
                        vision_drop_path_rate=flags.vision_drop_path_rate)
    parallel = ParallelConfig(
        world_size=world_size, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=flags.pipeline_model_parallel_size,
        context_parallel_size=flags.context_parallel_size, data_parallel_size=dp,
        virtual_pipeline_size=virtual_pipeline_size(flags), sequence_parallel=flags.sequence_parallel,
        expert_model_parallel_size=flags.expert_model_parallel_size,
        expert_tensor_parallel_size=flags.expert_tensor_parallel_size or tp, device=flags.device,
        distributed_timeout_minutes=flags.distributed_timeout_minutes,
        use_distributed_optimizer=flags.use_distributed_optimizer, overlap_grad_reduce=flags.overlap_grad_reduce,
        overlap_param_gather=flags.overlap_param_gather)
    data = DataConfig(data_path=flags.data_path, valid_data_path=flags.valid_data_path,
                      data_cache_dir=flags.data_cache_dir, tokenizer_model=flags.tokenizer_model,
                      media=media_overrides(flags), seq_length=flags.seq_length,
                      skip_bad_samples=flags.skip_bad_samples, max_skipped_fraction=flags.max_skipped_fraction,
                      truncate_long_samples=flags.truncate_long_samples,
                      num_workers=flags.num_workers, prefetch_factor=flags.prefetch_factor)
    balance = BalanceConfig(isf=flags.omnibal_isf, isf_fixed_params=isf_params_from_flags(flags),
                            isf_buffer=flags.omnibal_isf_buffer or DEFAULT_ISF_BUFFER, isf_stats=flags.omnibal_isf_stats,
                            isf_time_device=flags.omnibal_isf_time_device, isf_token_multiple=isf_token_multiple(flags),
                            pipeline_layout=flags.pipeline_layout, partition=flags.omnibal_partition,
                            profile=flags.omnibal_profile, recompute_granularity=flags.recompute_granularity,
                            recompute_plan=flags.recompute_plan, recompute=flags.omnibal_recompute,
                            memory_budget_gib=flags.omnibal_memory_budget)
    optim = OptimConfig(micro_batch_size=flags.micro_batch_size, global_batch_size=global_batch,
                        num_microbatches=microbatches, train_iters=flags.train_iters,
                        exit_interval=flags.exit_interval, seed=flags.seed, lr=flags.lr, min_lr=flags.min_lr,
                        vision_lr=flags.vision_lr, projector_lr=flags.projector_lr,
                        lr_decay_style=flags.lr_decay_style, lr_decay_iters=flags.lr_decay_iters,
                        lr_warmup_iters=flags.lr_warmup_iters,
                        override_opt_param_scheduler=flags.override_opt_param_scheduler,
                        use_checkpoint_opt_param_scheduler=flags.use_checkpoint_opt_param_scheduler,
                        check_for_nan_in_loss_and_grad=flags.check_for_nan_in_loss_and_grad,
                        weight_decay=flags.weight_decay, clip_grad=flags.clip_grad, adam_beta1=flags.adam_beta1,
                        adam_beta2=flags.adam_beta2, bf16=flags.bf16, loss_reduction=flags.loss_reduction)
    log = LogConfig(log_interval=flags.log_interval, tensorboard_dir=flags.tensorboard_dir, json_log=flags.json_log,
                    eval_interval=flags.eval_interval, eval_iters=flags.eval_iters, log_sample_ids=flags.log_sample_ids,
                    log_activation_memory=flags.log_activation_memory or flags.omnibal_recompute == "auto",
                    log_expert_load=flags.log_expert_load, eval_generate=flags.eval_generate,
                    eval_generate_samples=flags.eval_generate_samples)
    checkpoint = CheckpointConfig(save=flags.save, save_interval=flags.save_interval,
                                  keep_checkpoints=flags.keep_checkpoints, load=flags.load, ckpt_step=flags.ckpt_step,
                                  force_save_lock=flags.force_save_lock)
    return RunConfig(model=model, parallel=parallel, data=data, balance=balance, optim=optim, log=log,
                     checkpoint=checkpoint)
