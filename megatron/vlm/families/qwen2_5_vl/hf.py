"""Qwen2.5-VL's Hugging Face side: ``config.json`` -> ModelSpec (+ HFInfo) and back, tensor names, and the
mapping of its own units (patch embedding, ViT layers, merger) to our global tensors; the GPT decoder's units
map through ``megatron.vlm.hf.recipes``.

config.json comes in two forms, both read:
* nested (transformers 5 ``save_pretrained``): ``text_config`` (Qwen2.5 text: sizes, ``rope_parameters`` with
  ``rope_theta`` and ``mrope_section``), ``vision_config``, top-level ``tie_word_embeddings``, ``image_token_id``;
* flat (the published checkpoints): the text fields at the top level, ``rope_theta``, ``rope_scaling:
  {"type": "mrope", "mrope_section": [...]}``, ``vision_config`` with ``in_chans``.
Missing ViT keys take transformers' class defaults; what the model here does not implement is refused with
an HFConfigError naming the key.

Tensor names: "legacy" (what ``save_pretrained`` and the published checkpoints hold: ``visual.``,
``model.layers.``, ``lm_head.weight``) or "modern" (the in-memory names: ``model.visual.``,
``model.language_model.``).
"""
from __future__ import annotations

import dataclasses
import json

from omnibal_ext.model.spec import LanguageSpec, ModelSpec

from .costs import VisionSpec
from megatron.vlm.hf.config import HFConfigError, HFInfo, refuse, square
from megatron.vlm.hf.recipes import Part, Recipe, whole
from megatron.vlm.hf.text_configs import embed_name, layer_names, qwen2, rope, text_config, with_tie
from megatron.vlm.lineages.qwen.hf import vit_attention_recipes

MODEL_TYPES = ("qwen2_5_vl",)
DEFAULT_MROPE_SECTION = (16, 24, 24)  # transformers' default when the config names none
DEFAULT_THETA = 1000000.0  # Qwen2_5_VLTextConfig's rope_theta default


def recognizes(cfg: dict) -> bool:
    """Whether ``cfg`` is a Qwen2.5-VL config.json (model_type, or the architecture's name)."""
    return cfg.get("model_type") in MODEL_TYPES or any(
        str(a).startswith("Qwen2_5_VL") for a in cfg.get("architectures") or ())


def _language(t: dict, where: str, tie: bool) -> LanguageSpec:
    """Qwen2.5's text: the shared Qwen2 reader with multimodal RoPE (``mrope_section``; type "mrope" allowed)."""
    _, params = rope(t, where, DEFAULT_THETA, ("default", "mrope"))
    section = tuple(int(x) for x in (params.get("mrope_section") or DEFAULT_MROPE_SECTION))
    lang = qwen2(t, where, default_theta=DEFAULT_THETA, rope_kinds=("default", "mrope"), mrope_section=section)
    if lang.head_dim is not None:
        raise HFConfigError(f"{where}: head_dim {t['head_dim']} != hidden_size / num_attention_heads (Qwen2.5 "
                            "derives it)")
    return with_tie(lang, tie)


def _vision(v: dict, where: str, llm_hidden: int) -> VisionSpec:
    refuse(v, "hidden_act", where, lambda x: x == "silu", "only SiLU-gated ViT MLPs")
    refuse(v, "out_hidden_size", where, lambda x: int(x) == llm_hidden, f"the merger must output the LLM's "
                                                                         f"width {llm_hidden}")
    vision_rope = v.get("rope_parameters") or {}
    refuse(vision_rope, "rope_type", where + ".rope_parameters", lambda x: x in ("axial", "default"), "only 2-D axial RoPE")
    channels = v.get("in_channels", v.get("in_chans", 3))
    try:
        return VisionSpec(
            num_layers=int(v.get("depth", 32)), hidden_size=int(v.get("hidden_size", 3584)),
            num_attention_heads=int(v.get("num_heads", 16)), ffn_hidden_size=int(v.get("intermediate_size", 3420)),
            fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
            window_size=int(v.get("window_size", 112)), patch_size=square(v.get("patch_size", 14), "patch_size", where),
            temporal_patch_size=square(v.get("temporal_patch_size", 2), "temporal_patch_size", where),
            in_channels=int(channels), spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            rotary_base=int(float(vision_rope.get("rope_theta", 10000.0))),
            tokens_per_second=int(v.get("tokens_per_second", 4)))  # transformers default
    except HFConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the spec's own checks name the problem
        raise HFConfigError(f"{where}: {e}") from None


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of a Qwen2.5-VL ``config.json`` (nested or flat form)."""
    if "vision_config" not in cfg:
        raise HFConfigError(f"{where}: no vision_config (not a Qwen2.5-VL config)")
    nested = isinstance(cfg.get("text_config"), dict)
    t = cfg["text_config"] if nested else cfg
    tw = f"{where}: text_config" if nested else where
    tie = bool(cfg.get("tie_word_embeddings", False)) or bool(nested and t.get("tie_word_embeddings", False))
    lang = _language(t, tw, tie)
    vision = _vision(cfg["vision_config"], f"{where}: vision_config", lang.hidden_size)
    if vision.spatial_merge_size != 2 or vision.in_channels != 3:
        raise HFConfigError(f"{where}: vision_config: only a 2x2 merge of RGB patches is implemented")
    bad = [i for i in vision.fullatt_block_indexes if i >= vision.num_layers]
    if bad:
        raise HFConfigError(f"{where}: vision_config.fullatt_block_indexes {bad} are beyond depth {vision.num_layers}")
    spec = ModelSpec(name=name, vision=vision, language=lang, downsample_ratio=0.5, family="qwen2_5_vl")
    image_id = cfg.get("image_token_id", t.get("image_token_id"))
    video_id = cfg.get("video_token_id", t.get("video_token_id"))
    return spec, HFInfo("native", "qwen2", vision.num_layers, None if image_id is None else int(image_id),
                        video_token_id=None if video_id is None else int(video_id))


def native_config(spec: ModelSpec, info: HFInfo, source: dict | None) -> dict:
    """A config.json for ``spec``: the imported one as it was (a round trip writes the same file), else the
    nested transformers 5 form."""
    if source is not None:
        return json.loads(json.dumps(source))
    v, lang = spec.vision, spec.language
    text = {**text_config(lang, "qwen2"), "model_type": "qwen2_5_vl_text",
            "rope_parameters": {"rope_type": "default", "rope_theta": float(lang.rotary_base),
                                "mrope_section": list(lang.mrope_section or DEFAULT_MROPE_SECTION)}}
    vision = {"model_type": "qwen2_5_vl_vision", "depth": v.num_layers, "hidden_size": v.hidden_size,
              "num_heads": v.num_attention_heads, "intermediate_size": v.ffn_hidden_size, "hidden_act": "silu",
              "out_hidden_size": lang.hidden_size, "window_size": v.window_size,
              "fullatt_block_indexes": list(v.fullatt_block_indexes), "patch_size": v.patch_size,
              "temporal_patch_size": v.temporal_patch_size, "in_channels": v.in_channels,
              "spatial_merge_size": v.spatial_merge_size, "tokens_per_second": v.tokens_per_second,
              "rope_parameters": {"rope_type": "axial", "rope_theta": float(v.rotary_base)}}
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "text_config": text, "vision_config": vision, "image_token_id": info.image_token_id,
            **({} if info.video_token_id is None else {"video_token_id": info.video_token_id}),
            "tie_word_embeddings": lang.tie_word_embeddings}


class Names:
    """HF tensor names (``style`` "legacy": ``visual.`` / ``model.`` / ``lm_head.weight``, what checkpoints
    hold; "modern": ``model.visual.`` / ``model.language_model.``, the in-memory names)."""

    def __init__(self, info: HFInfo, style: str = "legacy"):
        self.info, self.style = info, style
        self.vit = "model.visual." if style == "modern" else "visual."
        self.llm = "model.language_model." if style == "modern" else "model."
        self.head = "lm_head.weight"

    def patch_embed(self) -> str:
        return self.vit + "patch_embed.proj.weight"

    def vit_layer(self, i: int) -> dict[str, str]:
        p = f"{self.vit}blocks.{i}."
        return {"qkv": p + "attn.qkv.", "proj": p + "attn.proj.", "norm1": p + "norm1.weight",
                "norm2": p + "norm2.weight", "gate": p + "mlp.gate_proj.", "up": p + "mlp.up_proj.",
                "down": p + "mlp.down_proj.", "prefix": p}

    def merger(self) -> dict[str, str]:
        p = self.vit + "merger."
        return {"norm": p + "ln_q.weight", "fc1": p + "mlp.0.", "fc2": p + "mlp.2."}

    def embed(self) -> str:
        return embed_name(self.llm, "qwen2")

    def llm_layer(self, i: int) -> dict[str, str]:
        return layer_names(f"{self.llm}layers.{i}.", "qwen2")

    def final_norm(self) -> str:
        return self.llm + "norm.weight"


def vision_embed_recipes(unit, table) -> None:
    v = table.spec.vision
    shape = (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    table.add(unit.name + ".proj.weight", whole(table.hf(table.names.patch_embed(), shape), shape))


def vision_layer_recipes(unit, table) -> None:
    """A ViT layer: its attention (``vit_attention_recipes``), norms and SwiGLU MLP with biases."""
    v, hf, add, u = table.spec.vision, table.hf, table.add, unit.name + "."
    H, Fv = v.hidden_size, v.ffn_hidden_size
    m = table.names.vit_layer(unit.layer)
    vit_attention_recipes(table, u, m, v.num_attention_heads, v.head_dim, H)
    add(u + "self_attention.linear_qkv.layer_norm_weight", whole(hf(m["norm1"], (H,)), (H,)))
    add(u + "mlp.linear_fc1.layer_norm_weight", whole(hf(m["norm2"], (H,)), (H,)))
    gate, up = hf(m["gate"] + "weight", (Fv, H)), hf(m["up"] + "weight", (Fv, H))
    add(u + "mlp.linear_fc1.weight", Recipe((2 * Fv, H), (Part(gate, 0, Fv), Part(up, 0, Fv))))
    gb, ub = hf(m["gate"] + "bias", (Fv,)), hf(m["up"] + "bias", (Fv,))
    add(u + "mlp.linear_fc1.bias", Recipe((2 * Fv,), (Part(gb, 0, Fv), Part(ub, 0, Fv))))
    add(u + "mlp.linear_fc2.weight", whole(hf(m["down"] + "weight", (H, Fv)), (H, Fv)))
    add(u + "mlp.linear_fc2.bias", whole(hf(m["down"] + "bias", (H,)), (H,)))


def merger_recipes(unit, table) -> None:
    v, hf, add, u = table.spec.vision, table.hf, table.add, unit.name + "."
    m = table.names.merger()
    Hv, W, Hl = v.hidden_size, v.hidden_size * v.merge_unit, table.spec.language.hidden_size
    add(u + "norm.weight", whole(hf(m["norm"], (Hv,)), (Hv,)))
    add(u + "fc1.weight", whole(hf(m["fc1"] + "weight", (W, W)), (W, W)))
    add(u + "fc1.bias", whole(hf(m["fc1"] + "bias", (W,)), (W,)))
    add(u + "fc2.weight", whole(hf(m["fc2"] + "weight", (Hl, W)), (Hl, W)))
    add(u + "fc2.bias", whole(hf(m["fc2"] + "bias", (Hl,)), (Hl,)))


def structure_twin(spec: ModelSpec) -> ModelSpec:
    """A tiny model with ``spec``'s structure (unit list with the same window/full layer kinds, heads)."""

    v, lang = spec.vision, spec.language
    vision = dataclasses.replace(v, hidden_size=4 * v.num_attention_heads, ffn_hidden_size=4)
    language = dataclasses.replace(lang, hidden_size=8, head_dim=2, ffn_hidden_size=4, vocab_size=128,
                                   real_vocab_size=None, mrope_section=(1, 0, 0))
    return spec.replace(vision=vision, language=language)
