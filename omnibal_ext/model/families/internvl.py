"""InternVL (InternVL-Chat, InternVL 2.5 / 3), planning side: InternViT over fixed-size tiles, the
pixel-shuffle MLP projector, and the published model sizes.

The ViT's work is counted in tiles (``MicroBatchShape.vision_items``): each tile runs
``seq_per_tile`` tokens (patches plus a class token) with full attention within the tile.

FLOPs (forward, one multiply-add = 2), ``s`` tokens per tile, ``h`` hidden, ``f`` MLP hidden:
* ViT layer, per tile: ``2*s*(4*h^2 + 2*h*f)`` (QKV + out projection, 2-matrix GELU MLP) plus attention
  scores and context ``4*s^2*h``; at TP sizes that do not divide the heads the layer runs
  ``padded_heads(tp)`` heads and its attention FLOPs grow with them.
* projector: ``2*n*(h_in*h_llm + h_llm^2)`` over ``n = tiles * tokens_per_tile`` tokens;
* patch embedding: ``2*patches*(C*p^2)*h`` per tile.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from ..components import (FUSED_KERNELS, ActBytes, CostComponent, HeadCost, TextEmbedCost, TextLayerCost,
                          layer_act_bytes_per_token, norm_bytes_per_token, sp_tokens)
from ..moe_cost import llm_layer_units
from ..spec import PROJECTOR, VISION_EMBED, VISION_LAYER, LanguageSpec, ModelSpec
from ..spec import vit_layers_for_feature_layer  # noqa: F401  (its HF reader's)
from ..lora import TARGETS as LORA_TARGETS
from . import Capabilities, Family, register


@dataclass(frozen=True)
class VisionSpec:
    """InternViT: pre-norm layers over the patch tokens of one tile plus a class token."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    image_size: int = 448  # tile side, pixels
    patch_size: int = 14  # pixels
    in_channels: int = 3
    normalization: str = "LayerNorm"  # or "RMSNorm" (InternViT-6B)
    norm_eps: float = 1e-6  # epsilon of the layer norms and of the qk-norm (HF: layer_norm_eps)
    qkv_bias: bool = True  # bias on the fused QKV projection (HF: attention_bias; InternViT-6B: none)
    qk_norm: bool = False  # RMSNorm of q and of k over the full width of all heads (HF: use_qk_norm)
    # layer scale: x + ls1 * attn(norm1(x)), x + ls2 * mlp(norm2(x)), ls1/ls2 trained vectors of [hidden]
    # starting at this value (HF: layer_scale_init_value); None: no layer scale
    layer_scale_init: float | None = None

    def __post_init__(self):
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise UserError(f"vision normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_heads(self, tp: int) -> int:
        """Attention heads the model is built with at tensor-parallel size ``tp``: the real heads rounded
        up to a multiple of ``tp`` (InternViT-6B's 25 heads divide by no TP > 1). The padded heads have
        zero weights, give zero output and zero gradients, and so stay zero under training."""
        return -(-self.num_attention_heads // tp) * tp

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_per_tile(self) -> int:
        """Tokens the ViT runs per tile: patches plus the class token."""
        return self.patches_per_tile + 1


def vit_layer_flops(spec: ModelSpec, tiles: int, tp: int = 1) -> tuple[float, float]:
    """(total, attention-core) forward FLOPs of one InternViT layer over ``tiles`` tiles, all TP ranks."""
    v = spec.vision
    s, h, f = v.seq_per_tile, v.hidden_size, v.ffn_hidden_size
    width = v.padded_heads(tp) * v.head_dim  # attention width: h without padding
    linear = 2.0 * s * (4 * h * width + 2 * h * f)
    core = 4.0 * s * s * width
    return tiles * (linear + core), tiles * core


class VisionEmbedCost(CostComponent):
    """Patch embedding of the tiles (a strided conv, 588-wide reduction: low efficiency), class token,
    learned positions."""

    kind, code, efficiency = "vit_embed", VISION_EMBED, 0.3

    def flops(self, shape, tp):
        v = self.spec.vision
        return shape.rank_vision_items * 2.0 * v.patches_per_tile * (v.in_channels * v.patch_size**2) * v.hidden_size, 0.0

    def params(self, tp):
        v = self.spec.vision
        n = v.in_channels * v.patch_size**2 * v.hidden_size + v.hidden_size  # conv + bias
        return n + v.hidden_size + v.seq_per_tile * v.hidden_size  # class token + position embedding

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        v, D = self.spec.vision, shape.dtype_bytes
        # the convolution keeps its input: under context parallelism a view of this rank's tiles into the pixels
        # of all the micro-batch's tiles (every CP rank decodes them all), which stay whole
        pixels = shape.vision_items * v.in_channels * v.image_size**2 * D
        return ActBytes(pixels, pixels, pixels, shape.rank_vision_items * v.seq_per_tile * v.hidden_size * D)


class VisionLayerCost(CostComponent):
    """One InternViT layer: full attention within each tile, GELU MLP, optional qk-norm and layer scale."""

    kind, code = "vit_layer", VISION_LAYER

    def flops(self, shape, tp):
        return vit_layer_flops(self.spec, shape.rank_vision_items, tp)

    def params(self, tp):
        v = self.spec.vision
        h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        n = 4 * h * width + 2 * h * f + (h + f + h) + 2 * h * (2 if v.normalization == "LayerNorm" else 1)
        n += 3 * width if v.qkv_bias else 0  # QKV bias
        n += 2 * width if v.qk_norm else 0  # q and k norm weights over the full width
        return n + (2 * h if v.layer_scale_init is not None else 0)  # ls1, ls2

    def linears(self, tp):
        v = self.spec.vision
        h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        return {"qkv": (h, 3 * width), "proj": (width, h), "fc1": (h, f), "fc2": (f, h)}

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # sequence parallel: every tile padded to a multiple of TP tokens (the pads masked out of attention)
        v, D = self.spec.vision, shape.dtype_bytes
        seq = sp_tokens(v.seq_per_tile, tp, sequence_parallel)
        tokens = shape.rank_vision_items * seq
        per_tok, core = layer_act_bytes_per_token(
            v.hidden_size, v.num_attention_heads, v.num_attention_heads, v.ffn_hidden_size, False,
            seq, D, tp, dropout, attention, norm=v.normalization, built_heads=v.padded_heads(tp),
            sequence_parallel=sequence_parallel, kernels=kernels)
        full = tokens * v.hidden_size * D / (tp if sequence_parallel else 1)
        return ActBytes(tokens * per_tok, full, tokens * (per_tok - core), full)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        v = self.spec.vision
        seq = sp_tokens(v.seq_per_tile, tp, sequence_parallel)  # all-gather + reduce-scatter of the padded tiles
        vit = shape.rank_vision_items * seq * v.hidden_size * shape.dtype_bytes
        return 2 * vit, 2 * vit


class ProjectorCost(CostComponent):
    """Pixel shuffle, LayerNorm and a 2-layer GELU MLP into the LLM's width (few tokens: lower efficiency)."""

    kind, code, efficiency = "projector", PROJECTOR, 0.4

    def _image_tokens(self, shape) -> int:
        return shape.rank_vision_items * self.spec.tokens_per_tile

    def flops(self, shape, tp):
        hi, ho = self.spec.projector_in_size, self.spec.language.hidden_size
        return 2.0 * self._image_tokens(shape) * (hi * ho + ho**2), 0.0

    def params(self, tp):
        hi, ho = self.spec.projector_in_size, self.spec.language.hidden_size
        return 2 * hi + hi * ho + ho + ho * ho + ho

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        hi, ho, D = self.spec.projector_in_size, self.spec.language.hidden_size, shape.dtype_bytes
        n = self._image_tokens(shape)
        # LayerNorm input, statistics and output, GELU input, fc2 input
        act = n * (2 * hi * D + norm_bytes_per_token(hi, D, "LayerNorm", kernels) + 2 * ho * D / tp)
        return ActBytes(act, n * hi * D, act, n * ho * D)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        img = self._image_tokens(shape) * self.spec.language.hidden_size * shape.dtype_bytes
        return img, img


def unit_list(spec: ModelSpec):
    units = [("vit.embed", VisionEmbedCost, None)]
    units += [(f"vit.layer.{i}", VisionLayerCost, i) for i in range(spec.vision.num_layers)]
    units += [("projector", ProjectorCost, None), ("llm.embed", TextEmbedCost, None)]
    units += llm_layer_units(spec)  # MoE layers (LanguageSpec.moe) at their own kind
    return units + [("llm.head", HeadCost, None)]


# --------------------------------------------------------------------------------------------
# Presets.  Sizes of the paper's models are the published ones (InternVL-Chat-V1.5 family):
# InternViT-6B (45 layers used, hidden 3200, 25 heads, MLP 12800, 448px tiles, patch 14, RMSNorm,
# qk-norm, no qkv bias, layer scale starting at 0.1),
# InternLM2-20B (48 layers, hidden 6144, 48 heads, 8 KV heads, MLP 16384, vocabulary 92544, no qkv bias,
# untied embeddings),
# Nous-Hermes-2-Yi-34B (60 layers, hidden 7168, 56 heads, 8 KV heads, MLP 20480, vocabulary 64000).
# --------------------------------------------------------------------------------------------
INTERNVIT_6B = VisionSpec(
    num_layers=45, hidden_size=3200, num_attention_heads=25, ffn_hidden_size=12800,
    image_size=448, patch_size=14, normalization="RMSNorm", norm_eps=1e-6, qkv_bias=False, qk_norm=True,
    layer_scale_init=0.1,
)

NAME = "internvl"

PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        family=NAME, name="tiny",
        vision=VisionSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                          image_size=32, patch_size=8),
        language=LanguageSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192,
                              num_query_groups=2, vocab_size=384),
        # 0.02 suits hidden sizes in the thousands; at 64 it leaves attention uniform for long and
        # the ViT-to-LLM alignment of a model trained from scratch crawls (measured: digits val
        # accuracy 19% vs 47% after 1000 steps with 0.06).
        init_method_std=0.06,
    ),
    "internvl-6b-20b": ModelSpec(
        family=NAME, name="internvl-6b-20b",
        vision=INTERNVIT_6B,
        language=LanguageSpec(num_layers=48, hidden_size=6144, num_attention_heads=48, ffn_hidden_size=16384,
                              num_query_groups=8, vocab_size=92544, rotary_base=1000000),
    ),
    "internvl-6b-34b": ModelSpec(
        family=NAME, name="internvl-6b-34b",
        vision=INTERNVIT_6B,
        language=LanguageSpec(num_layers=60, hidden_size=7168, num_attention_heads=56, ffn_hidden_size=20480,
                              num_query_groups=8, vocab_size=64000, rotary_base=5000000),
    ),
}

# --------------------------------------------------------------------------------------------
# The current InternVL family (InternVL3: InternViT-300M-448px-V2_5 + Qwen2.5).  Sources: the model
# cards of InternVL3-1B/2B/8B (vision part InternViT-300M-448px-V2_5, language part Qwen2.5-0.5B/1.5B/
# 7B-Instruct) and their config.json (vision_config, llm_config), which carry the sizes of
# InternViT-300M-448px-V2_5 (24 layers, hidden 1024, 16 heads, MLP 4096, 448 px, patch 14, LayerNorm)
# and of the Qwen2.5 configs (layers, hidden, heads, KV heads, MLP, rope_theta 1e6).  Vocabulary: the
# checkpoints' embedding has 151674 rows (llm_config.vocab_size: Qwen2.5's tokens + InternVL's special
# tokens), padded here to 151680, the next multiple of 128 (Megatron's --make-vocab-size-divisible-by),
# the padded rows masked out of the softmax.  Features: InternViT's layer scale (0.1) and qkv bias,
# Qwen2's q/k/v bias and RMSNorm epsilon 1e-6.  The output layer is counted untied (a checkpoint's
# config.json says whether it is tied; --hf-checkpoint takes that from it).
# InternVL2.5-26B (InternViT-6B-448px-V2_5, 45 layers used, + InternLM2.5-20B-chat) has the same
# sizes as "internvl-6b-20b" (InternVL-Chat-V1-5) in every field here, so it is no separate preset.
# --------------------------------------------------------------------------------------------
INTERNVIT_300M = VisionSpec(
    num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
    image_size=448, patch_size=14, normalization="LayerNorm", qkv_bias=True, layer_scale_init=0.1,
)
QWEN2_5_VOCAB_INTERNVL = 151680  # 151674 rows in the checkpoints, padded to a multiple of 128
QWEN2_5 = dict(vocab_size=QWEN2_5_VOCAB_INTERNVL, real_vocab_size=151674, rotary_base=1000000, qkv_bias=True,
               norm_eps=1e-6)

PRESETS.update({
    "internvl3-1b": ModelSpec(  # Qwen2.5-0.5B
        family=NAME, name="internvl3-1b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=24, hidden_size=896, num_attention_heads=14, ffn_hidden_size=4864,
                              num_query_groups=2, **QWEN2_5),
    ),
    "internvl3-2b": ModelSpec(  # Qwen2.5-1.5B
        family=NAME, name="internvl3-2b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=28, hidden_size=1536, num_attention_heads=12, ffn_hidden_size=8960,
                              num_query_groups=2, **QWEN2_5),
    ),
    "internvl3-8b": ModelSpec(  # Qwen2.5-7B
        family=NAME, name="internvl3-8b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=28, hidden_size=3584, num_attention_heads=28, ffn_hidden_size=18944,
                              num_query_groups=4, **QWEN2_5),
    ),
})

# --------------------------------------------------------------------------------------------
# InternVL3.5 (dense): InternViT-300M-448px-V2_5 (InternViT-6B-448px-V2_5 for 38B) + Qwen3. Sources: the
# InternVL3.5 quick-start table (OpenGVLab's InternVL docs: vision / language parameters 0.3B / 0.8B, 2.0B, 4.4B,
# 8.2B, 14.8B and 5.5B / 32.8B), the llm_config of OpenGVLab/InternVL3_5-1B and -8B (Qwen3-0.6B and Qwen3-8B:
# model_type qwen3, head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6, no attention bias, vocab_size 151936, no
# tie_word_embeddings key: Qwen3Config's default, untied) and the Qwen3 configs of the other language parts
# (Qwen3-1.7B, -4B, -14B, -32B). Their language parameters equal the table's only untied (Qwen3-0.6B/1.7B/4B are
# tied as text models, not inside InternVL3.5). tests/test_internvl3_5.py checks the numbers and the totals.
# --------------------------------------------------------------------------------------------
QWEN3 = dict(vocab_size=151936, rotary_base=1000000, norm_eps=1e-6, head_dim=128, qk_norm=True, qkv_bias=False)


def _internvl3_5(name: str, vision: VisionSpec, layers: int, hidden: int, heads: int, groups: int, ffn: int
                 ) -> ModelSpec:
    return ModelSpec(family=NAME, name=name, vision=vision, language=LanguageSpec(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, **QWEN3))


PRESETS.update({
    "internvl3.5-1b": _internvl3_5("internvl3.5-1b", INTERNVIT_300M, 28, 1024, 16, 8, 3072),  # Qwen3-0.6B
    "internvl3.5-2b": _internvl3_5("internvl3.5-2b", INTERNVIT_300M, 28, 2048, 16, 8, 6144),  # Qwen3-1.7B
    "internvl3.5-4b": _internvl3_5("internvl3.5-4b", INTERNVIT_300M, 36, 2560, 32, 8, 9728),  # Qwen3-4B
    "internvl3.5-8b": _internvl3_5("internvl3.5-8b", INTERNVIT_300M, 36, 4096, 32, 8, 12288),  # Qwen3-8B
    "internvl3.5-14b": _internvl3_5("internvl3.5-14b", INTERNVIT_300M, 40, 5120, 40, 8, 17408),  # Qwen3-14B
    "internvl3.5-38b": _internvl3_5("internvl3.5-38b", INTERNVIT_6B, 64, 5120, 64, 8, 25600),  # Qwen3-32B
})


# --------------------------------------------------------------------------------------------
# InternVL3.5-MoE: InternViT-300M-448px-V2_5 + Qwen3-30B-A3B (30B-A3B) and InternViT-6B-448px-V2_5 + Qwen3-235B-A22B
# (241B-A28B). The Qwen3-MoE configs: 48 / 94 layers, hidden 2048 / 4096, 32 / 64 heads, 4 KV heads, head_dim 128,
# intermediate_size 6144 / 12288 (no dense layer uses it: decoder_sparse_step 1, no mlp_only_layers), 128 experts of
# moe_intermediate_size 768 / 1536, top 8 with norm_topk_prob true, rope_theta 1e6, vocab 151936, untied.
# tests/test_internvl3_5_moe.py checks the numbers and the totals.
# --------------------------------------------------------------------------------------------
def _internvl3_5_moe(name: str, vision: VisionSpec, layers: int, hidden: int, heads: int, ffn: int, expert_ffn: int
                     ) -> ModelSpec:
    import dataclasses

    from ..moe import MoESpec, layer_freq_from_qwen

    dense = _internvl3_5(name, vision, layers, hidden, heads, 4, ffn)
    moe = MoESpec(num_experts=128, topk=8, ffn_hidden_size=expert_ffn, layer_freq=layer_freq_from_qwen(layers, 1))
    return dense.replace(language=dataclasses.replace(dense.language, moe=moe))


PRESETS.update({
    "internvl3.5-30b-a3b": _internvl3_5_moe("internvl3.5-30b-a3b", INTERNVIT_300M, 48, 2048, 32, 6144, 768),
    "internvl3.5-241b-a28b": _internvl3_5_moe("internvl3.5-241b-a28b", INTERNVIT_6B, 94, 4096, 64, 12288, 1536),
})


def spec_problem(spec: ModelSpec) -> str | None:
    """The image size must be whole patches, and the patch grid pixel-shuffled by the downsample ratio."""
    v = spec.vision
    if v.image_size % v.patch_size:
        return f"--patch-size {v.patch_size} does not divide --image-size {v.image_size}"
    grid = v.image_size // v.patch_size
    if grid % int(round(1 / spec.downsample_ratio)):
        return f"the ViT patch grid {grid}x{grid} cannot be pixel-shuffled by {spec.downsample_ratio}"
    return None


INTERNVL = register(Family(
    name=NAME, default_preset="tiny", vision_spec=VisionSpec,
    components=(VisionEmbedCost, VisionLayerCost, ProjectorCost, TextEmbedCost, TextLayerCost, HeadCost),
    unit_list=unit_list, vision_item="tile", presets=PRESETS, spec_problem=spec_problem,
    capabilities=Capabilities(drop_path=True, context_parallel=True, sequence_parallel=True, moe=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--max-num-tiles", "--min-num-tiles"))))
