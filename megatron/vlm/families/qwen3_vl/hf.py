"""Qwen3-VL's Hugging Face side: ``config.json`` -> ModelSpec (+ HFInfo) and back, tensor names, and the mapping of
its own units (patch embedding with the position table, ViT layers, DeepStack mergers, merger) to our global
tensors; the Qwen3 decoder's units map through ``megatron.vlm.hf.recipes``.

config.json is nested (``text_config``, ``vision_config``) in both forms read:
* transformers 5 (``save_pretrained``): ``text_config.rope_parameters`` with ``rope_theta``, ``mrope_section``,
  ``mrope_interleaved``;
* transformers 4.x (the published checkpoints): ``text_config.rope_scaling`` with ``mrope_section`` /
  ``mrope_interleaved``, and ``rope_theta`` beside it.
transformers' Qwen3-VL always interleaves the sections (``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``,
whatever ``mrope_interleaved`` says), and so does the model here. Missing ViT keys take transformers' class
defaults; what the model here does not implement is refused with an HFConfigError naming the key, and so is a
config with more DeepStack indexes than LLM layers (transformers drops the extra features silently).

Tensor names (what ``save_pretrained`` and the published checkpoints hold): ``model.visual.``,
``model.language_model.``, ``lm_head.weight``.

Qwen3-VL-MoE (``model_type`` "qwen3_vl_moe", text ``qwen3_vl_moe_text``): the Qwen3 decoder with MoE layers where
Qwen's rule puts them (``text_configs.qwen_experts``; the router always renormalises its top k; ``head_dim``
hidden / heads when missing, the text config class's default; tied by the top-level ``tie_word_embeddings`` only).
Each MoE layer holds ``mlp.gate.weight [E, H]`` (the router) and the fused experts ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj [E, H, I]``, as transformers keeps them in memory and
a 5.x ``save_pretrained`` writes them; the published files hold them transposed (``[E, H, 2I]``, ``[E, I, H]``),
which transformers undoes on load where the shape is not the in-memory one. Import reads either (per tensor, by
its shape: ``checkpoint_info``), each expert's block straight from the file (an EP rank reads only its experts),
and export writes the layout that was read.
"""
from __future__ import annotations

import dataclasses
import json

from omnibal_ext.model.spec import LanguageSpec, ModelSpec

from . import QWEN3_VL
from megatron.vlm.hf.config import HFConfigError, HFInfo, require
from megatron.vlm.hf.recipes import Part, add_moe_llm_layer
from megatron.vlm.hf.text_configs import moe_config, qwen3, qwen_experts, rope, with_tie
from megatron.vlm.lineages.qwen.qwen3_vit.hf import (FUSED_EXPERTS, Names, checkpoint_info, fused_shapes,  # noqa: F401
                                                     vision_spec)

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
MOE_TEXT = "qwen3_vl_moe"  # HFInfo.text_family of an MoE decoder
DEFAULT_MROPE_SECTION = (24, 20, 20)  # transformers' default when the config names none


def recognizes(cfg: dict) -> bool:
    """Whether ``cfg`` is a (dense) Qwen3-VL config.json (model_type, or the architecture's name)."""
    arch = cfg.get("architectures") or ()
    return cfg.get("model_type") in MODEL_TYPES or any(a in arch for a in ("Qwen3VLForConditionalGeneration",
                                                                          "Qwen3VLMoeForConditionalGeneration"))


def is_moe(cfg: dict) -> bool:
    """A Qwen3-VL-MoE config.json (model_type or architecture)."""
    return cfg.get("model_type") == "qwen3_vl_moe" or "Qwen3VLMoeForConditionalGeneration" in (
        cfg.get("architectures") or ())


DEFAULT_THETA = 5000000.0  # transformers' Qwen3VLTextConfig rope_theta


def _language(t: dict, where: str, tie: bool, moe: bool = False) -> LanguageSpec:
    """Qwen3-VL's text: the shared Qwen3 reader with interleaved multimodal RoPE (``mrope_section``; type "mrope"
    allowed; the form transformers 4.x wrote, ``rope_scaling`` beside ``rope_theta``, too); ``moe``: Qwen3-VL-MoE's
    (module docstring)."""
    kinds = ("default", "mrope")
    _, params = rope(t, where, DEFAULT_THETA, kinds)
    section = tuple(int(x) for x in (params.get("mrope_section") or DEFAULT_MROPE_SECTION))
    extra = {}
    if moe:
        extra["moe"] = qwen_experts(t, where, norm_topk_prob_default=None)
        if not t.get("head_dim"):  # Qwen3VLMoeTextConfig: hidden / heads (Qwen3's own default is 128)
            hidden, heads = int(require(t, "hidden_size", where)), int(require(t, "num_attention_heads", where))
            t = {**t, "head_dim": hidden // heads}
    lang = qwen3(t, where, default_theta=DEFAULT_THETA, rope_kinds=kinds, mrope_section=section,
                 mrope_interleaved=True, **extra)
    return with_tie(lang, tie)


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of a Qwen3-VL ``config.json`` (transformers 5 or 4.x form)."""
    t, v = cfg.get("text_config"), cfg.get("vision_config")
    if not isinstance(t, dict) or not isinstance(v, dict):
        raise HFConfigError(f"{where}: a Qwen3-VL config.json has text_config and vision_config")
    moe = is_moe(cfg)
    tie = bool(cfg.get("tie_word_embeddings", False)) or (not moe and bool(t.get("tie_word_embeddings", False)))
    lang = _language(t, f"{where}: text_config", tie, moe)
    vision = vision_spec(v, f"{where}: vision_config", lang.hidden_size)
    if vision.spatial_merge_size != 2 or vision.in_channels != 3:
        raise HFConfigError(f"{where}: vision_config: only a 2x2 merge of RGB patches is implemented")
    spec = ModelSpec(name=name, vision=vision, language=lang, downsample_ratio=0.5, family="qwen3_vl")
    problem = QWEN3_VL.spec_problem(spec)
    if problem:
        raise HFConfigError(f"{where}: {problem}")
    image_id = cfg.get("image_token_id", t.get("image_token_id"))
    video_id = cfg.get("video_token_id", t.get("video_token_id"))
    return spec, HFInfo("native", MOE_TEXT if moe else "qwen3", vision.num_layers,
                        None if image_id is None else int(image_id),
                        video_token_id=None if video_id is None else int(video_id))


def native_config(spec: ModelSpec, info: HFInfo, source: dict | None) -> dict:
    """A config.json for ``spec``: the imported one as it was (a round trip writes the same file), else the
    transformers 5 form."""
    if source is not None:
        return json.loads(json.dumps(source))
    v, lang = spec.vision, spec.language
    text = {"model_type": "qwen3_vl_text", "hidden_size": lang.hidden_size, "num_hidden_layers": lang.num_layers,
            "num_attention_heads": lang.num_attention_heads, "num_key_value_heads": lang.kv_groups,
            "head_dim": lang.kv_channels, "intermediate_size": lang.ffn_hidden_size, "vocab_size": lang.vocab_real,
            "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": lang.norm_eps,
            "tie_word_embeddings": lang.tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(lang.rotary_base),
                                "mrope_section": list(lang.mrope_section or DEFAULT_MROPE_SECTION),
                                "mrope_interleaved": True}}
    vision = {"model_type": "qwen3_vl_vision", "depth": v.num_layers, "hidden_size": v.hidden_size,
              "num_heads": v.num_attention_heads, "intermediate_size": v.ffn_hidden_size,
              "hidden_act": "gelu_pytorch_tanh", "out_hidden_size": lang.hidden_size,
              "num_position_embeddings": v.num_position_embeddings,
              "deepstack_visual_indexes": list(v.deepstack_visual_indexes), "patch_size": v.patch_size,
              "temporal_patch_size": v.temporal_patch_size, "in_channels": v.in_channels,
              "spatial_merge_size": v.spatial_merge_size,
              "rope_parameters": {"rope_type": "axial", "rope_theta": float(v.rotary_base)}}
    if lang.moe is not None:
        experts = {k: v for k, v in moe_config(lang).items() if k != "norm_topk_prob"}  # always renormalised
        text.update(model_type="qwen3_vl_moe_text", **experts)
        vision["model_type"] = "qwen3_vl_moe_vision"
    moe = lang.moe is not None
    return {"architectures": ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
            "text_config": text, "vision_config": vision, "image_token_id": info.image_token_id,
            **({} if info.video_token_id is None else {"video_token_id": info.video_token_id}),
            "tie_word_embeddings": lang.tie_word_embeddings}


def moe_layer_recipes(unit, table) -> None:
    """An MoE layer: the shared recipes with the experts' blocks of the fused tensors (expert e: rows of
    ``gate_up_proj[e]`` and ``down_proj[e]``, or their columns where the files hold them transposed)."""
    m = table.names.llm_layer(unit.layer)
    spec, info = table.spec, table.info
    F, H = spec.language.moe.ffn_hidden_size, spec.language.hidden_size
    shapes = fused_shapes(spec)
    gate_up, down = (table.hf(m["experts"] + kind, shape[:1] + shape[:0:-1] if kind in info.transposed else shape)
                     for kind, shape in zip(FUSED_EXPERTS, shapes))
    t_gate_up, t_down = (kind in info.transposed for kind in FUSED_EXPERTS)

    def experts(e):
        return (Part(gate_up, 0, F, index=e, transposed=t_gate_up),
                Part(gate_up, F, 2 * F, index=e, transposed=t_gate_up), Part(down, 0, H, index=e, transposed=t_down))

    add_moe_llm_layer(table.add, table.hf, m, unit.name + ".", spec, info, experts)


def structure_twin(spec: ModelSpec) -> ModelSpec:
    """A tiny model with ``spec``'s structure (unit list with the same layer kinds, heads, DeepStack indexes)."""

    v, lang = spec.vision, spec.language
    vision = dataclasses.replace(v, hidden_size=4 * v.num_attention_heads, ffn_hidden_size=4, num_position_embeddings=4)
    moe = lang.moe and dataclasses.replace(lang.moe, ffn_hidden_size=4)
    language = dataclasses.replace(lang, hidden_size=8, head_dim=2, ffn_hidden_size=4, vocab_size=128,
                                   real_vocab_size=None, mrope_section=(1, 0, 0), moe=moe)
    return spec.replace(vision=vision, language=language)
