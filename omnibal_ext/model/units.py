"""The one ordered list of pipeline units of a VLM, and the model sizes it is made from.

Every part of OmniBal speaks of the same units by the same names: the trainer builds a pipeline
stage from a contiguous slice of the list, the profiler and the cost model give each unit its
costs, the partition search splits the list, the recompute planner chooses over it and the
simulator replays it.  The order is fixed::

    vit.embed, vit.layer.0 .. vit.layer.{Lv-1}, projector, llm.embed, llm.layer.0 .. llm.layer.{Ll-1}, llm.head
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import UserError

# Unit kinds, in pipeline order, with the one-letter code used by the layout syntax.
KIND_CODES = {
    "vit_embed": "I",  # patch embedding of image tiles (+ class token, position embedding)
    "vit_layer": "v",  # one ViT transformer layer
    "projector": "P",  # pixel shuffle + MLP into the LLM's hidden size
    "llm_embed": "E",  # token embedding, image features scattered into image-context positions
    "llm_layer": "t",  # one LLM transformer layer
    "llm_head": "L",  # final norm, output layer and loss
}
CODE_KINDS = {code: kind for kind, code in KIND_CODES.items()}


@dataclass(frozen=True)
class VisionSpec:
    """A ViT encoder (InternViT-style: pre-norm layers over patch tokens of one tile plus a class token)."""

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


@dataclass(frozen=True)
class LanguageSpec:
    """A GPT decoder (InternLM2 / Llama style: RMSNorm, SwiGLU, grouped-query attention, RoPE)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int | None = None  # None: multi-head attention
    vocab_size: int = 384  # padded vocabulary (rows of the embedding and output layer)
    swiglu: bool = True
    normalization: str = "RMSNorm"
    rotary_base: int = 10000
    # ids the tokenizer really has (None: all ``vocab_size`` rows are real); the padded rows' logits are
    # masked out of the softmax and the argmax
    real_vocab_size: int | None = None
    head_dim: int | None = None  # per-head width (HF: head_dim); None: hidden_size // num_attention_heads
    qkv_bias: bool = False  # bias on q, k, v (not on the output projection): Qwen2
    norm_eps: float = 1e-5  # RMSNorm epsilon (HF: rms_norm_eps)
    # HF rope_scaling; no scaling type is implemented, so it must be None (the converter passes the
    # checkpoint's value and gets a UserError naming the type)
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False  # the output layer uses the input embedding's weight

    def __post_init__(self):
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) \
                if isinstance(self.rope_scaling, dict) else self.rope_scaling
            if kind not in (None, "default"):
                raise UserError(f"RoPE scaling type {kind!r} is not implemented (rope_scaling {self.rope_scaling}); "
                                "only plain RoPE (rope_scaling None or type 'default') is supported")
        if self.real_vocab_size is not None and not 1 <= self.real_vocab_size <= self.vocab_size:
            raise UserError(f"real vocabulary size {self.real_vocab_size} must be in [1, {self.vocab_size}] "
                            "(the padded vocabulary)")

    @property
    def kv_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Per-head width: ``head_dim`` when given, else hidden / heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def vocab_real(self) -> int:
        """Rows of the vocabulary that are real ids (the rest is padding)."""
        return self.real_vocab_size or self.vocab_size


@dataclass(frozen=True)
class ModelSpec:
    """A whole VLM: ViT -> projector (pixel shuffle by ``downsample_ratio``, then an MLP) -> LLM."""

    name: str
    vision: VisionSpec
    language: LanguageSpec
    downsample_ratio: float = 0.5
    init_method_std: float = 0.02  # std of the normal weight init (Megatron's --init-method-std)

    @property
    def tokens_per_tile(self) -> int:
        """LLM image-context tokens one tile becomes after pixel shuffle."""
        return int(round(self.vision.patches_per_tile * self.downsample_ratio**2))

    @property
    def projector_in_size(self) -> int:
        return int(round(self.vision.hidden_size / self.downsample_ratio**2))

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        return cls(
            name=d["name"],  # fields missing from older dicts take their defaults
            vision=VisionSpec(**d["vision"]),
            language=LanguageSpec(**d["language"]),
            downsample_ratio=d.get("downsample_ratio", 0.5),
            init_method_std=d.get("init_method_std", 0.02),
        )


@dataclass(frozen=True)
class Unit:
    """One entry of the pipeline unit list."""

    name: str  # stable name, e.g. "vit.layer.3"
    kind: str  # one of KIND_CODES
    index: int  # position in the unit list
    layer: int | None = None  # layer number within its encoder/decoder for *_layer kinds

    @property
    def code(self) -> str:
        return KIND_CODES[self.kind]


def build_units(spec: ModelSpec) -> list[Unit]:
    """The ordered unit list of ``spec``."""
    entries: list[tuple[str, str, int | None]] = [("vit.embed", "vit_embed", None)]
    entries += [(f"vit.layer.{i}", "vit_layer", i) for i in range(spec.vision.num_layers)]
    entries += [("projector", "projector", None), ("llm.embed", "llm_embed", None)]
    entries += [(f"llm.layer.{i}", "llm_layer", i) for i in range(spec.language.num_layers)]
    entries += [("llm.head", "llm_head", None)]
    return [Unit(name, kind, i, layer) for i, (name, kind, layer) in enumerate(entries)]


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

PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
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
        name="internvl-6b-20b",
        vision=INTERNVIT_6B,
        language=LanguageSpec(num_layers=48, hidden_size=6144, num_attention_heads=48, ffn_hidden_size=16384,
                              num_query_groups=8, vocab_size=92544, rotary_base=1000000),
    ),
    "internvl-6b-34b": ModelSpec(
        name="internvl-6b-34b",
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
        name="internvl3-1b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=24, hidden_size=896, num_attention_heads=14, ffn_hidden_size=4864,
                              num_query_groups=2, **QWEN2_5),
    ),
    "internvl3-2b": ModelSpec(  # Qwen2.5-1.5B
        name="internvl3-2b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=28, hidden_size=1536, num_attention_heads=12, ffn_hidden_size=8960,
                              num_query_groups=2, **QWEN2_5),
    ),
    "internvl3-8b": ModelSpec(  # Qwen2.5-7B
        name="internvl3-8b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=28, hidden_size=3584, num_attention_heads=28, ffn_hidden_size=18944,
                              num_query_groups=4, **QWEN2_5),
    ),
})


def vit_layers_for_feature_layer(num_hidden_layers: int, vision_feature_layer: int) -> int:
    """ViT layers to build for a checkpoint of ``num_hidden_layers`` layers whose features are taken at
    HF ``vision_feature_layer``: the model simply has that many layers (the later ones are not loaded).

    HF indexes ``hidden_states`` with it: entry 0 is the embedding output, entry i the output of layer i,
    so -1 (InternVL's usual value: ``last_hidden_state``, no final norm as ``use_mean_pooling`` leaves it
    out) is all layers, -k is ``num_hidden_layers + 1 - k`` layers, and k >= 1 is k layers.
    """
    n = num_hidden_layers + 1 + vision_feature_layer if vision_feature_layer < 0 else vision_feature_layer
    if not 1 <= n <= num_hidden_layers:
        raise UserError(f"vision_feature_layer {vision_feature_layer} selects no ViT layer of {num_hidden_layers} "
                        f"(valid: -{num_hidden_layers}..-1 or 1..{num_hidden_layers})")
    return n


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
