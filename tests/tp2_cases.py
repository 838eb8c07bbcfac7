"""Models of the TP-2 checks, built the same way at TP 1 (in the test process) and TP 2 (torchrun worker)."""
import dataclasses

import torch

from omnibal_ext.model.units import build_units, get_preset

REAL_HEADS, HEAD_DIM = 3, 16  # 3 heads: padded to 4 at TP 2


def vit_spec():
    base = get_preset("tiny")
    vision = dataclasses.replace(base.vision, hidden_size=REAL_HEADS * HEAD_DIM, num_attention_heads=REAL_HEADS,
                                 ffn_hidden_size=96, normalization="RMSNorm", qkv_bias=False, qk_norm=True,
                                 layer_scale_init=0.5)
    return base.replace(vision=vision)


def vit_layer_and_input(tp: int):
    """The layer (weights drawn per unit: the same at TP 1 and 2), this rank's slice of non-trivial
    qk-norm weights, an input that wants its gradient, and the output-gradient seed."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron.vlm.layers.config import vision_config
    from megatron.vlm.families.internvl.layers import layer_spec as _layer_spec

    spec = vit_spec()
    cfg = vision_config(spec, tp, True, torch.float32)
    layer = build_module(_layer_spec("RMSNorm", AttnMaskType.no_mask, 5, 1, real_heads=REAL_HEADS, vision=spec.vision),
                         config=cfg, layer_number=1)
    g = torch.Generator().manual_seed(11)
    width = cfg.num_attention_heads * HEAD_DIM  # padded
    full = []
    for _ in range(2):
        w = torch.ones(width)
        w[: REAL_HEADS * HEAD_DIM] = 1 + 0.3 * torch.randn(REAL_HEADS * HEAD_DIM, generator=g)
        full.append(w)
    rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    per = width // tp
    with torch.no_grad():
        layer.self_attention.q_layernorm.weight.copy_(full[0][rank * per:(rank + 1) * per])
        layer.self_attention.k_layernorm.weight.copy_(full[1][rank * per:(rank + 1) * per])
        # the replicated norms, layer scales and biases away from their constant starts too
        for i, (name, p) in enumerate(layer.named_parameters()):
            if name.endswith(("linear_proj.bias", "linear_fc2.bias")) or "bda" in name or \
                    name.startswith(("input_layernorm", "pre_mlp")):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i)))
    x = torch.randn(17, 3, REAL_HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(12)).requires_grad_()
    return layer, x, 13, full


def run_vit(layer, x, grad_seed):
    out = layer(hidden_states=x, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    (out * w).sum().backward()
    return out


def tiny_model(tp: int, real_vocab: bool, vocab_size: int | None = None):
    from megatron.vlm.stage.build import StageBuild, build_stage

    spec = get_preset("tiny")
    lang = spec.language
    if vocab_size is not None:
        lang = dataclasses.replace(lang, vocab_size=vocab_size)
    if real_vocab:
        lang = dataclasses.replace(lang, real_vocab_size=264)
    spec = spec.replace(language=lang)
    units = build_units(spec)
    return build_stage(StageBuild(spec, range(len(units)), tp=tp, img_context_id=263, seed=3))


# A Qwen3 decoder layer: 4 heads in 2 key-value groups, head_dim 12 (not hidden / heads = 8), per-head q/k norm
QWEN3 = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, head_dim=12,
             ffn_hidden_size=48, vocab_size=128, rotary_base=50000, norm_eps=1e-6, qk_norm=True)
QWEN3_TOKENS = 9


def qwen3_layer_and_input(tp: int):
    """A Qwen3 LLM layer as the shared TextLayer builds it (weights drawn per unit: the same at TP 1 and 2; the
    q/k-norm and layer-norm weights moved off their constant start), its [s, 1, d] RoPE table, an input that
    wants its gradient and the output-gradient seed. megatron-core's unfused attention with its causal mask."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron.vlm.layers import blocks as layers
    from megatron.vlm.layers.config import language_config
    from megatron.vlm.layers.layer_impl import LayerImpl
    from omnibal_ext.model.spec import LanguageSpec

    spec = get_preset("tiny").replace(language=LanguageSpec(**QWEN3))
    cfg = language_config(spec, tp, True, torch.float32)
    dense = LayerImpl.of("local", "unfused")
    layer_spec = layers.with_qk_norm(layers.layer_spec("RMSNorm", AttnMaskType.causal, 5, 1, dense))
    layer = build_module(layer_spec, config=cfg, layer_number=1)
    with torch.no_grad():
        for i, (name, p) in enumerate(layer.named_parameters()):
            if "layernorm" in name or "layer_norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i)))
    rope = RotaryEmbedding(kv_channels=spec.language.kv_channels, rotary_percent=1.0,
                           rotary_base=spec.language.rotary_base, use_cpu_initialization=True)(QWEN3_TOKENS)
    x = torch.randn(QWEN3_TOKENS, 1, 32, generator=torch.Generator().manual_seed(12)).requires_grad_()
    return layer, rope, x, 13


def run_qwen3(layer, rope, x, grad_seed):
    out = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
    out = out[0] if isinstance(out, tuple) else out
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    (out * w).sum().backward()
    return out
