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

import json

from omnibal_ext.model.families.qwen3_vl import VisionSpec, qwen3_language, spec_problem
from omnibal_ext.model.spec import LanguageSpec, ModelSpec

from megatron.vlm.families.qwen2_5_vl.hf import vit_attention_recipes
from megatron.vlm.hf.config import HFConfigError, HFInfo, padded_vocab, refuse, require, square
from megatron.vlm.hf.text_configs import moe_config, qwen3, qwen_experts, rope, with_tie
from megatron.vlm.hf.recipes import Part, add_llm_layer, add_moe_llm_layer, whole

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
MOE_TEXT = "qwen3_vl_moe"  # HFInfo.text_family of an MoE decoder
FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # an MoE layer's stacked expert tensors (mlp.experts.<name>)
DEFAULT_MROPE_SECTION = (24, 20, 20)  # transformers' default when the config names none
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, num_position_embeddings=2304,
                       deepstack_visual_indexes=(8, 16, 24), patch_size=16, temporal_patch_size=2, in_channels=3,
                       spatial_merge_size=2)  # transformers' Qwen3VLVisionConfig defaults


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


def _vision(v: dict, where: str, llm_hidden: int) -> VisionSpec:
    refuse(v, "hidden_act", where, lambda x: x == "gelu_pytorch_tanh", "only the gelu_pytorch_tanh ViT MLP")
    refuse(v, "out_hidden_size", where, lambda x: int(x) == llm_hidden,
            f"the mergers must output the LLM's width {llm_hidden}")
    rope = v.get("rope_parameters") or {}
    refuse(rope, "rope_type", where + ".rope_parameters", lambda x: x == "axial", "only 2-D axial RoPE")
    d = {**VISION_DEFAULTS, **{k: v[k] for k in VISION_DEFAULTS if v.get(k) is not None}}
    try:
        return VisionSpec(
            num_layers=int(d["depth"]), hidden_size=int(d["hidden_size"]), num_attention_heads=int(d["num_heads"]),
            ffn_hidden_size=int(d["intermediate_size"]), num_position_embeddings=int(d["num_position_embeddings"]),
            deepstack_visual_indexes=tuple(d["deepstack_visual_indexes"]),
            patch_size=square(d["patch_size"], "patch_size", where),
            temporal_patch_size=square(d["temporal_patch_size"], "temporal_patch_size", where),
            in_channels=int(d["in_channels"]), spatial_merge_size=int(d["spatial_merge_size"]),
            rotary_base=int(float(rope.get("rope_theta", 10000.0))))
    except HFConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the spec's own checks name the problem (deepstack_visual_indexes, ...)
        raise HFConfigError(f"{where}: {e}") from None


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of a Qwen3-VL ``config.json`` (transformers 5 or 4.x form)."""
    t, v = cfg.get("text_config"), cfg.get("vision_config")
    if not isinstance(t, dict) or not isinstance(v, dict):
        raise HFConfigError(f"{where}: a Qwen3-VL config.json has text_config and vision_config")
    moe = is_moe(cfg)
    tie = bool(cfg.get("tie_word_embeddings", False)) or (not moe and bool(t.get("tie_word_embeddings", False)))
    lang = _language(t, f"{where}: text_config", tie, moe)
    vision = _vision(v, f"{where}: vision_config", lang.hidden_size)
    if vision.spatial_merge_size != 2 or vision.in_channels != 3:
        raise HFConfigError(f"{where}: vision_config: only a 2x2 merge of RGB patches is implemented")
    spec = ModelSpec(name=name, vision=vision, language=lang, downsample_ratio=0.5, family="qwen3_vl")
    problem = spec_problem(spec)
    if problem:
        raise HFConfigError(f"{where}: {problem}")
    image_id = cfg.get("image_token_id", t.get("image_token_id"))
    video_id = cfg.get("video_token_id", t.get("video_token_id"))
    return spec, HFInfo("native", MOE_TEXT if moe else "qwen3", vision.num_layers,
                        None if image_id is None else int(image_id),
                        video_token_id=None if video_id is None else int(video_id))


def checkpoint_info(info: HFInfo, spec: ModelSpec, reader) -> HFInfo:
    """``info`` with the fused expert tensors the files hold transposed (``HFInfo.transposed``): each kind as its
    first MoE layer's shape says (the in-memory shape: not transposed, as transformers decides)."""
    import dataclasses

    lang = spec.language
    if lang.moe is None:
        return info
    names = Names(info)
    layer = lang.moe.moe_layers[0]
    transposed = []
    for kind, shape in zip(FUSED_EXPERTS, _fused_shapes(spec)):
        name = names.llm_layer(layer)["experts"] + kind
        if name in reader.names() and tuple(reader.shape(name)) != shape:
            transposed.append(kind)
    return dataclasses.replace(info, transposed=tuple(transposed))


def _fused_shapes(spec: ModelSpec) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The in-memory shapes of ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    lang = spec.language
    E, F, H = lang.moe.num_experts, lang.moe.ffn_hidden_size, lang.hidden_size
    return (E, 2 * F, H), (E, H, F)


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


class Names:
    """HF tensor names (``model.visual.`` / ``model.language_model.`` / ``lm_head.weight``, what transformers 4.57
    and 5 save; ``style`` is accepted for the shared converter and has one value)."""

    def __init__(self, info: HFInfo, style: str = "modern"):
        self.info, self.style = info, style
        self.vit, self.llm, self.head = "model.visual.", "model.language_model.", "lm_head.weight"

    def patch_embed(self) -> str:
        return self.vit + "patch_embed.proj."

    def pos_embed(self) -> str:
        return self.vit + "pos_embed.weight"

    def vit_layer(self, i: int) -> dict[str, str]:
        p = f"{self.vit}blocks.{i}."
        return {"qkv": p + "attn.qkv.", "proj": p + "attn.proj.", "norm1": p + "norm1.", "norm2": p + "norm2.",
                "fc1": p + "mlp.linear_fc1.", "fc2": p + "mlp.linear_fc2.", "prefix": p}

    def merger(self) -> dict[str, str]:
        p = self.vit + "merger."
        return {"norm": p + "norm.", "fc1": p + "linear_fc1.", "fc2": p + "linear_fc2."}

    def deepstack_merger(self, j: int) -> dict[str, str]:
        p = f"{self.vit}deepstack_merger_list.{j}."
        return {"norm": p + "norm.", "fc1": p + "linear_fc1.", "fc2": p + "linear_fc2."}

    def embed(self) -> str:
        return self.llm + "embed_tokens.weight"

    def llm_layer(self, i: int) -> dict[str, str]:
        p = f"{self.llm}layers.{i}."
        return {"q": p + "self_attn.q_proj.", "k": p + "self_attn.k_proj.", "v": p + "self_attn.v_proj.",
                "o": p + "self_attn.o_proj.weight", "q_norm": p + "self_attn.q_norm.weight",
                "k_norm": p + "self_attn.k_norm.weight", "gate": p + "mlp.gate_proj.weight",
                "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight",
                "norm1": p + "input_layernorm.weight", "norm2": p + "post_attention_layernorm.weight",
                "router": p + "mlp.gate.weight", "experts": p + "mlp.experts."}

    def final_norm(self) -> str:
        return self.llm + "norm.weight"


def _pair(table, key: str, hf_prefix: str, shape) -> None:
    """Our ``{key}weight`` / ``{key}bias`` from HF ``{hf_prefix}weight`` / ``bias`` (``shape``: the weight's)."""
    table.add(key + "weight", whole(table.hf(hf_prefix + "weight", shape), shape))
    table.add(key + "bias", whole(table.hf(hf_prefix + "bias", (shape[0],)), (shape[0],)))


def vision_embed_recipes(unit, table) -> None:
    v, u = table.spec.vision, unit.name + "."
    _pair(table, u + "proj.", table.names.patch_embed(),
          (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size))
    shape = (v.num_position_embeddings, v.hidden_size)
    table.add(u + "pos_embed.weight", whole(table.hf(table.names.pos_embed(), shape), shape))


def vision_layer_recipes(unit, table) -> None:
    """A ViT layer: attention per real head (Qwen2.5-VL's layout), LayerNorms with bias, the 2-matrix MLP."""
    v, u = table.spec.vision, unit.name + "."
    H, Fv = v.hidden_size, v.ffn_hidden_size
    m = table.names.vit_layer(unit.layer)
    vit_attention_recipes(table, u, m, v.num_attention_heads, v.head_dim, H)
    for ours, theirs in (("self_attention.linear_qkv.layer_norm_", m["norm1"]), ("mlp.linear_fc1.layer_norm_", m["norm2"])):
        table.add(u + ours + "weight", whole(table.hf(theirs + "weight", (H,)), (H,)))
        table.add(u + ours + "bias", whole(table.hf(theirs + "bias", (H,)), (H,)))
    _pair(table, u + "mlp.linear_fc1.", m["fc1"], (Fv, H))
    _pair(table, u + "mlp.linear_fc2.", m["fc2"], (H, Fv))


def _merger(table, u: str, m: dict, norm_width: int) -> None:
    v = table.spec.vision
    W, Hl = v.hidden_size * v.merge_unit, table.spec.language.hidden_size
    table.add(u + "norm.weight", whole(table.hf(m["norm"] + "weight", (norm_width,)), (norm_width,)))
    table.add(u + "norm.bias", whole(table.hf(m["norm"] + "bias", (norm_width,)), (norm_width,)))
    _pair(table, u + "fc1.", m["fc1"], (W, W))
    _pair(table, u + "fc2.", m["fc2"], (Hl, W))


def merger_recipes(unit, table) -> None:
    _merger(table, unit.name + ".", table.names.merger(), table.spec.vision.hidden_size)


def deepstack_merger_recipes(unit, table) -> None:
    """The DeepStack merger of a ViT layer unit (its tensors under the unit's name): HF
    ``deepstack_merger_list.{j}``, ``j`` the layer's place in ``deepstack_visual_indexes``."""
    v = table.spec.vision
    _merger(table, unit.name + ".deepstack_merger.", table.names.deepstack_merger(v.deepstack_slot(unit.layer)),
            v.hidden_size * v.merge_unit)


def llm_layer_recipes(unit, table) -> None:
    add_llm_layer(table.add, table.hf, table.names.llm_layer(unit.layer), unit.name + ".", table.spec, table.info)


def moe_layer_recipes(unit, table) -> None:
    """An MoE layer: the shared recipes with the experts' blocks of the fused tensors (expert e: rows of
    ``gate_up_proj[e]`` and ``down_proj[e]``, or their columns where the files hold them transposed)."""
    m = table.names.llm_layer(unit.layer)
    spec, info = table.spec, table.info
    F, H = spec.language.moe.ffn_hidden_size, spec.language.hidden_size
    shapes = _fused_shapes(spec)
    gate_up, down = (table.hf(m["experts"] + kind, shape[:1] + shape[:0:-1] if kind in info.transposed else shape)
                     for kind, shape in zip(FUSED_EXPERTS, shapes))
    t_gate_up, t_down = (kind in info.transposed for kind in FUSED_EXPERTS)

    def experts(e):
        return (Part(gate_up, 0, F, index=e, transposed=t_gate_up),
                Part(gate_up, F, 2 * F, index=e, transposed=t_gate_up), Part(down, 0, H, index=e, transposed=t_down))

    add_moe_llm_layer(table.add, table.hf, m, unit.name + ".", spec, info, experts)


def structure_twin(spec: ModelSpec) -> ModelSpec:
    """A tiny model with ``spec``'s structure (unit list with the same layer kinds, heads, DeepStack indexes)."""
    import dataclasses

    v, lang = spec.vision, spec.language
    vision = dataclasses.replace(v, hidden_size=4 * v.num_attention_heads, ffn_hidden_size=4, num_position_embeddings=4)
    moe = lang.moe and dataclasses.replace(lang.moe, ffn_hidden_size=4)
    language = dataclasses.replace(lang, hidden_size=8, head_dim=2, ffn_hidden_size=4, vocab_size=128,
                                   real_vocab_size=None, mrope_section=(1, 0, 0), moe=moe)
    return spec.replace(vision=vision, language=language)
