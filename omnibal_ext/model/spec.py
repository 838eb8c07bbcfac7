"""What every model family shares: the unit roles of the layout language, a unit of the pipeline unit
list, the language-model (GPT decoder) spec and the whole model's spec.

A family (``omnibal_ext.model.families``) says which units its model has, in pipeline order, and what
each costs; shared code speaks of units only through their role (the layout letter) and their
kinds' costs (``unit_kind.UnitKind``), never through a family's kind names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from .moe import MoESpec

# Unit roles: the one-letter codes of the layout syntax, the same for every family. A family may have
# several kinds of unit in one role (window and full-attention ViT layers are both ``v``).
VISION_EMBED = "I"  # turns images into the ViT's first hidden states
VISION_LAYER = "v"  # one ViT transformer layer
PROJECTOR = "P"  # ViT features into the LLM's hidden size
TEXT_EMBED = "E"  # token embedding, image features written into the image-token positions
TEXT_LAYER = "t"  # one LLM transformer layer
HEAD = "L"  # final norm, output layer and loss
ROLES = {VISION_EMBED: "ViT embedding", VISION_LAYER: "ViT layer", PROJECTOR: "ViT-to-LLM projector",
         TEXT_EMBED: "LLM embedding", TEXT_LAYER: "LLM layer", HEAD: "output head"}
LAYER_ROLES = (VISION_LAYER, TEXT_LAYER)  # the recomputable transformer layers


@dataclass(frozen=True)
class Unit:
    """One entry of the pipeline unit list."""

    name: str  # stable global name, e.g. "vit.layer.3": checkpoint keys and profiles use it
    kind: str  # the family's component kind (data for reports; only the family branches on it)
    index: int  # position in the unit list
    code: str  # role: one of ROLES (the layout letter)
    layer: int | None = None  # layer number within its encoder / decoder for layer roles


@dataclass(frozen=True)
class SideTensor:
    """A tensor that one unit produces and later units read, carried beside the hidden states: within a stage in
    the forward's cache, across stage boundaries with the activations (DeepStack features).

    name: its name on both sides (``megatron.vlm.stage.side``); producer: the unit index that makes it; consumers: the
    unit indices that read it (it is live on every boundary between the producer and its last consumer); width:
    values per row (every TP rank holds whole rows: side tensors are replicated over TP, also under sequence
    parallelism); rows: what its rows count per micro-batch ("image_tokens": the LLM image tokens of the vision
    items this CP rank's ViT runs, ``DataSide.side_rows`` at run time, ``omnibal_ext.model.side_bytes`` when
    planning).  Across stages it travels packed with the hidden states (``megatron.vlm.stage.side``)."""

    name: str
    producer: int
    consumers: tuple[int, ...]
    width: int
    rows: str = "image_tokens"

    @property
    def last_consumer(self) -> int:
        return max(self.consumers)


@dataclass(frozen=True)
class LanguageSpec:
    """A GPT decoder (InternLM2 / Llama / Qwen2 / Qwen3 style: RMSNorm, SwiGLU, grouped-query attention, RoPE)."""

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
    # multimodal RoPE: the rotary frequencies (head_dim / 2 of them) cut into sections
    # rotated by the temporal, height and width position ids (HF: mrope_section; megatron-core's
    # TransformerConfig.mrope_section); None: plain 1-D RoPE
    mrope_section: tuple[int, ...] | None = None
    # the sections interleaved (HF: mrope_interleaved): frequency j rotates by the height id when
    # j % 3 == 1 and j < 3 * section[1], by the width id when j % 3 == 2 and j < 3 * section[2], else by the
    # temporal id (megatron/vlm/layers/rope.py); False: consecutive chunks of section[0], section[1], section[2]
    mrope_interleaved: bool = False
    # RMSNorm of every query and key head over its head_dim values, before RoPE (Qwen3; HF: q_norm / k_norm)
    qk_norm: bool = False
    # mixture-of-experts layers (``omnibal_ext.model.moe``); None: a dense decoder
    moe: MoESpec | None = None

    def __post_init__(self):
        self._check_moe()
        if self.mrope_interleaved and self.mrope_section is None:
            raise UserError("mrope_interleaved needs an mrope_section (interleaved multimodal RoPE)")
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(int(x) for x in self.mrope_section))
            if len(self.mrope_section) != 3 or min(self.mrope_section) < 0 \
                    or 2 * sum(self.mrope_section) != self.rotary_dim:
                raise UserError(f"mrope_section {list(self.mrope_section)} must be three sections summing to "
                                f"the rotary dimensions / 2 = {self.rotary_dim // 2}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) \
                if isinstance(self.rope_scaling, dict) else self.rope_scaling
            if kind not in (None, "default"):
                raise UserError(f"RoPE scaling type {kind!r} is not implemented (rope_scaling {self.rope_scaling}); "
                                "only plain RoPE (rope_scaling None or type 'default') is supported")
        if self.real_vocab_size is not None and not 1 <= self.real_vocab_size <= self.vocab_size:
            raise UserError(f"real vocabulary size {self.real_vocab_size} must be in [1, {self.vocab_size}] "
                            "(the padded vocabulary)")

    def _check_moe(self) -> None:
        """``moe`` from a dict (a spec's JSON) made an ``MoESpec``; its per-layer list must cover the layers."""
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoESpec.from_dict(self.moe))
        if self.moe is not None and len(self.moe.layer_freq) != self.num_layers:
            raise UserError(f"MoESpec.layer_freq has {len(self.moe.layer_freq)} entries for the decoder's "
                            f"{self.num_layers} layers")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has experts."""
        return self.moe is not None and self.moe.is_moe(layer)

    @property
    def kv_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Per-head width: ``head_dim`` when given, else hidden / heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (all of ``kv_channels``; a family with partial rotary says
        fewer)."""
        return self.kv_channels

    @property
    def vocab_real(self) -> int:
        """Rows of the vocabulary that are real ids (the rest is padding)."""
        return self.real_vocab_size or self.vocab_size


@dataclass(frozen=True)
class ModelSpec:
    """A whole VLM: ViT -> projector (merging patches by ``downsample_ratio`` per side) -> LLM.

    family: the model family's name (``omnibal_ext.model.families``); ``vision`` is that family's ViT
    spec (a frozen dataclass with ``num_layers``, ``hidden_size``, ``num_attention_heads``,
    ``padded_heads(tp)`` and ``normalization``).
    """

    name: str
    vision: Any
    language: LanguageSpec
    downsample_ratio: float = 0.5
    init_method_std: float = 0.02  # std of the normal weight init (Megatron's --init-method-std)
    family: str = field(kw_only=True)  # the registered family's name: every spec names its own (no default)

    @property
    def tokens_per_tile(self) -> int:
        """LLM image tokens one fixed-size tile becomes after the patch merge (families whose ViT spec
        has ``patches_per_tile``: fixed-size tiles)."""
        return int(round(self.vision.patches_per_tile * self.downsample_ratio**2))

    @property
    def projector_in_size(self) -> int:
        return int(round(self.vision.hidden_size / self.downsample_ratio**2))

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def vit_layers_for_feature_layer(num_hidden_layers: int, vision_feature_layer: int) -> int:
    """ViT layers to build for a checkpoint of ``num_hidden_layers`` layers whose features are taken at
    HF ``vision_feature_layer``: the model simply has that many layers (the later ones are not loaded).

    HF indexes ``hidden_states`` with it: entry 0 is the embedding output, entry i the output of layer i,
    so -1 (the usual value: ``last_hidden_state``) is all layers, -k is ``num_hidden_layers + 1 - k`` layers,
    and k >= 1 is k layers.
    """
    n = num_hidden_layers + 1 + vision_feature_layer if vision_feature_layer < 0 else vision_feature_layer
    if not 1 <= n <= num_hidden_layers:
        raise UserError(f"vision_feature_layer {vision_feature_layer} selects no ViT layer of {num_hidden_layers} "
                        f"(valid: -{num_hidden_layers}..-1 or 1..{num_hidden_layers})")
    return n
