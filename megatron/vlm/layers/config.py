"""megatron-core TransformerConfigs for the ViT, the LLM and the pipeline stage module."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from omnibal_ext.model.units import ModelSpec

from megatron.vlm.layers.moe import config_fields


def _common(*, tp: int, pp: int, on_cpu: bool, dtype: torch.dtype, init_method_std: float) -> dict:
    fused = not on_cpu  # kernels that need CUDA (../shared/notes/megatron_core_cpu.md)
    return dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        use_cpu_initialization=True,  # draw full matrices then split: same weights for every TP size
        perform_initialization=True,
        init_method_std=init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=fused,
        bias_activation_fusion=False,
        bias_dropout_fusion=fused,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,  # stage outputs change shape along the pipeline
        moe_token_dispatcher_type="alltoall",  # 0.16.1 rejects variable_seq_lengths otherwise
        batch_p2p_comm=not on_cpu,  # batched p2p on gloo gives wrong gradients with interleaving
        deallocate_pipeline_outputs=True,  # megatron frees a sent stage output's .data (keeps its grad_fn)
    )


def vision_config(spec: ModelSpec, tp: int, on_cpu: bool, dtype: torch.dtype) -> TransformerConfig:
    v = spec.vision
    return TransformerConfig(
        num_layers=v.num_layers, hidden_size=v.hidden_size, num_attention_heads=v.padded_heads(tp),
        kv_channels=v.head_dim, ffn_hidden_size=v.ffn_hidden_size, add_bias_linear=True,
        # with add_bias_linear megatron-core always gives linear_qkv a bias; qkv_bias=False swaps in a
        # bias-free linear_qkv in the layer spec (the family's layer spec)
        add_qkv_bias=v.qkv_bias, gated_linear_unit=False,
        # qk-norm over the full width of all heads: the q_layernorm/k_layernorm submodules are FullWidthQKNorm
        qk_layernorm=v.qk_norm,
        activation_func=F.gelu, normalization=v.normalization, layernorm_epsilon=v.norm_eps,
        **_common(tp=tp, pp=1, on_cpu=on_cpu, dtype=dtype, init_method_std=spec.init_method_std))


def language_config(spec: ModelSpec, tp: int, on_cpu: bool, dtype: torch.dtype, pp: int = 1,
                    moe_run=None) -> TransformerConfig:
    """The LLM's TransformerConfig; with ``spec.language.moe`` its MoE fields, trained as ``moe_run``
    (``megatron.vlm.layers.moe.MoERun``; None: its defaults)."""

    lang = spec.language
    common = _common(tp=tp, pp=pp, on_cpu=on_cpu, dtype=dtype, init_method_std=spec.init_method_std)
    common.update(config_fields(lang.moe, moe_run, tp))
    return TransformerConfig(
        num_layers=lang.num_layers, hidden_size=lang.hidden_size, num_attention_heads=lang.num_attention_heads,
        num_query_groups=lang.kv_groups, kv_channels=lang.kv_channels, ffn_hidden_size=lang.ffn_hidden_size,
        add_bias_linear=False, add_qkv_bias=lang.qkv_bias,  # Qwen2: bias on q, k, v only
        # Qwen3's per-head q/k norms come from the layer spec (PerHeadRMSNorm sums its own gradient over TP);
        # qk_layernorm stays False, or finalize_model_grads would sum every "q_layernorm" again, the ViT's too
        qk_layernorm=False,
        gated_linear_unit=lang.swiglu, activation_func=F.silu if lang.swiglu else F.gelu,
        normalization=lang.normalization, layernorm_epsilon=lang.norm_eps, **common)
