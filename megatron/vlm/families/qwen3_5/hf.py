"""Qwen3.5's Hugging Face side: ``config.json`` -> ModelSpec (+ HFInfo) and back, tensor names, and the mapping of
its LLM layers (gated attention, Gated DeltaNet) and zero-centred norms to our global tensors; the ViT, the merger
and their names are Qwen3-VL's (``qwen3_vl.hf``, no DeepStack).

config.json is nested (``text_config``, ``vision_config``), transformers 5's form: ``text_config.rope_parameters``
with ``rope_theta``, ``mrope_section``, ``mrope_interleaved`` and ``partial_rotary_factor`` (also read beside it,
at the top of ``text_config``), ``layer_types`` (absent: every fourth layer full, transformers' default), the
``linear_*`` sizes. What the model here does not implement is refused with an HFConfigError naming the key.

Tensor names: ``model.visual.``, ``model.language_model.layers.<i>.self_attn.`` (full attention: ``q_proj`` rows
``[q | gate]`` per head, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``) or ``.linear_attn.``
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``,
``out_proj``), ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``;
``model.language_model.norm``, ``embed_tokens``, ``lm_head.weight``. Norm weights are stored as HF has them
(``w`` of ``1 + w``).

Qwen3.5-MoE (``model_type`` "qwen3_5_moe", text ``qwen3_5_moe_text``): every layer's MLP is the sparse MoE block
(``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``; no dense
``intermediate_size``), the router ``mlp.gate.weight [E, H]`` always renormalising its top k, the experts stacked as
the published files hold them (``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows first, ``down_proj [E, H, I]``)
or one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``: what transformers 5.23's
``save_pretrained`` writes), ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate.weight
[1, H]`` (``sigmoid(x . w)`` times the shared expert's output: megatron-core's ``moe_shared_expert_gate``). Import
reads either layout (``checkpoint_info``), each expert's block straight from the file (an EP rank reads only its
experts), and export writes the layout that was read.

Our global tensors of a layer (``llm.layer.<i>.``): full attention: ``self_attention.linear_qkv.weight`` per
key-value group ``[q of its heads | gate of its heads | k | v]`` (megatron-core's gated layout), the per-head
``q_layernorm`` / ``k_layernorm``; Gated DeltaNet: ``self_attention.in_proj.weight.{q,k,v,z,b,a}``,
``conv1d.weight.{q,k,v}`` (its checkpoint parts, ``gated_delta_net.sharded_state_dict``), ``A_log``, ``dt_bias``,
``out_norm.weight``, ``out_proj.weight``, ``input_layernorm.weight``.
"""
from __future__ import annotations

import dataclasses
import json

from omnibal_ext.model.spec import ModelSpec

from . import QWEN3_5
from .costs import FULL, LINEAR, qwen3_5_language, qwen3_5_moe_experts
from megatron.vlm.hf.config import HFConfigError, HFInfo, padded_vocab, refuse, require
from megatron.vlm.hf.recipes import Part, Recipe, whole
from megatron.vlm.hf.text_configs import rope
from megatron.vlm.lineages.qwen.qwen3_vit import hf as qwen3_vit_hf

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
MOE_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
FUSED_EXPERTS = qwen3_vit_hf.FUSED_EXPERTS  # mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]
DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding default


def recognizes(cfg: dict) -> bool:
    """Whether ``cfg`` is a (dense) Qwen3.5 config.json (model_type, or the architecture's name)."""
    return cfg.get("model_type") in MODEL_TYPES or any(
        a in (cfg.get("architectures") or ()) for a in ("Qwen3_5ForConditionalGeneration", MOE_ARCHITECTURE))


def is_moe(cfg: dict) -> bool:
    """A Qwen3.5-MoE config.json (model_type or architecture)."""
    return cfg.get("model_type") == "qwen3_5_moe" or MOE_ARCHITECTURE in (cfg.get("architectures") or ())


def _experts(t: dict, where: str):
    """Qwen3.5-MoE's experts (``Qwen3_5MoeTextConfig``): every layer MoE (it has no ``mlp_only_layers`` /
    ``decoder_sparse_step``: refused when given otherwise), the top k of ``num_experts`` renormalised (its router
    always does), a shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate."""

    refuse(t, "mlp_only_layers", where, lambda x: not x, "every layer MoE (Qwen3.5-MoE has no dense layers)")
    refuse(t, "decoder_sparse_step", where, lambda x: int(x) == 1, "every layer MoE (decoder_sparse_step 1)")
    refuse(t, "norm_topk_prob", where, lambda x: bool(x), "the top-k renormalised (Qwen3.5-MoE's router)")
    shared = int(require(t, "shared_expert_intermediate_size", where))
    if shared < 1:
        raise HFConfigError(f"{where}: shared_expert_intermediate_size {shared}: Qwen3.5-MoE has a shared expert")
    return qwen3_5_moe_experts(int(require(t, "num_hidden_layers", where)), int(require(t, "num_experts", where)),
                               int(require(t, "num_experts_per_tok", where)),
                               int(require(t, "moe_intermediate_size", where)), shared)


def _rope(t: dict, where: str) -> tuple[int, tuple[int, ...], float]:
    """(rope theta, mrope_section, partial_rotary_factor), read by the shared ``rope`` (``rope_parameters``, or
    ``rope_theta`` + ``rope_scaling``)."""
    theta, params = rope(t, where, 10000000.0, ("default", "mrope"))
    section = params.get("mrope_section")
    factor = params.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
    return theta, tuple(int(x) for x in (section or DEFAULT_MROPE_SECTION)), float(factor)


def _language(t: dict, where: str, tie: bool, moe: bool = False):
    refuse(t, "hidden_act", where, lambda x: x == "silu", "only SiLU-gated MLPs")
    refuse(t, "attention_bias", where, lambda x: not x, "no attention bias")
    theta, section, factor = _rope(t, where)
    heads = int(require(t, "num_attention_heads", where))
    layers = int(require(t, "num_hidden_layers", where))
    real = int(require(t, "vocab_size", where))
    types = t.get("layer_types")
    if types is not None and len(types) != layers:
        raise HFConfigError(f"{where}: layer_types has {len(types)} entries, num_hidden_layers is {layers}")
    experts = _experts(t, where) if moe else None
    ffn = experts.shared_expert_ffn_hidden_size if moe else int(require(t, "intermediate_size", where))
    try:
        return qwen3_5_language(
            num_layers=layers, hidden_size=int(require(t, "hidden_size", where)), num_attention_heads=heads,
            ffn_hidden_size=ffn, moe=experts,
            num_query_groups=int(t.get("num_key_value_heads") or heads), head_dim=int(t.get("head_dim", 256)),
            vocab_size=padded_vocab(real), real_vocab_size=real, rotary_base=theta,
            norm_eps=float(t.get("rms_norm_eps", 1e-6)), tie_word_embeddings=tie, mrope_section=section,
            partial_rotary_factor=factor, layer_types=tuple(types or ()),
            linear_num_key_heads=int(t.get("linear_num_key_heads", 16)),
            linear_key_head_dim=int(t.get("linear_key_head_dim", 128)),
            linear_num_value_heads=int(t.get("linear_num_value_heads", 32)),
            linear_value_head_dim=int(t.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim", 4)))
    except HFConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the spec's own checks (layer_types, mrope_section) name the problem
        raise HFConfigError(f"{where}: {e}") from None


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of a Qwen3.5 ``config.json``."""
    t, v = cfg.get("text_config"), cfg.get("vision_config")
    if not isinstance(t, dict) or not isinstance(v, dict):
        raise HFConfigError(f"{where}: a Qwen3.5 config.json has text_config and vision_config")
    if v.get("deepstack_visual_indexes"):
        raise HFConfigError(f"{where}: vision_config.deepstack_visual_indexes: Qwen3.5's ViT has no DeepStack")
    tie = bool(cfg.get("tie_word_embeddings", False)) or bool(t.get("tie_word_embeddings", False))
    lang = _language(t, f"{where}: text_config", tie, is_moe(cfg))
    vision = qwen3_vit_hf.vision_spec({**v, "deepstack_visual_indexes": []}, f"{where}: vision_config", lang.hidden_size)
    if vision.spatial_merge_size != 2 or vision.in_channels != 3:
        raise HFConfigError(f"{where}: vision_config: only a 2x2 merge of RGB patches is implemented")
    spec = ModelSpec(name=name, vision=vision, language=lang, downsample_ratio=0.5, family="qwen3_5")
    problem = QWEN3_5.spec_problem(spec)
    if problem:
        raise HFConfigError(f"{where}: {problem}")
    image_id = cfg.get("image_token_id", t.get("image_token_id"))
    return spec, HFInfo("native", "qwen3_5", vision.num_layers, None if image_id is None else int(image_id))


def native_config(spec: ModelSpec, info: HFInfo, source: dict | None) -> dict:
    """A config.json for ``spec``: the imported one as it was (a round trip writes the same file), else the
    transformers 5 form."""
    if source is not None:
        return json.loads(json.dumps(source))
    v, lang = spec.vision, spec.language
    text = {"model_type": "qwen3_5_text", "hidden_size": lang.hidden_size, "num_hidden_layers": lang.num_layers,
            "num_attention_heads": lang.num_attention_heads, "num_key_value_heads": lang.kv_groups,
            "head_dim": lang.kv_channels, "intermediate_size": lang.ffn_hidden_size, "vocab_size": lang.vocab_real,
            "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": lang.norm_eps,
            "tie_word_embeddings": lang.tie_word_embeddings, "layer_types": list(lang.layer_types),
            "linear_num_key_heads": lang.linear_num_key_heads, "linear_key_head_dim": lang.linear_key_head_dim,
            "linear_num_value_heads": lang.linear_num_value_heads,
            "linear_value_head_dim": lang.linear_value_head_dim,
            "linear_conv_kernel_dim": lang.linear_conv_kernel_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(lang.rotary_base),
                                "mrope_section": list(lang.mrope_section), "mrope_interleaved": True,
                                "partial_rotary_factor": lang.partial_rotary_factor}}
    vision = {"model_type": "qwen3_5_vision", "depth": v.num_layers, "hidden_size": v.hidden_size,
              "num_heads": v.num_attention_heads, "intermediate_size": v.ffn_hidden_size,
              "hidden_act": "gelu_pytorch_tanh", "out_hidden_size": lang.hidden_size,
              "num_position_embeddings": v.num_position_embeddings, "patch_size": v.patch_size,
              "temporal_patch_size": v.temporal_patch_size, "in_channels": v.in_channels,
              "spatial_merge_size": v.spatial_merge_size,
              "rope_parameters": {"rope_type": "axial", "rope_theta": float(v.rotary_base)}}
    if lang.moe is not None:
        moe = lang.moe
        del text["intermediate_size"]
        text.update(model_type="qwen3_5_moe_text", num_experts=moe.num_experts, num_experts_per_tok=moe.topk,
                    moe_intermediate_size=moe.ffn_hidden_size,
                    shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size)
        vision["model_type"] = "qwen3_5_moe_vision"
    return {"architectures": [MOE_ARCHITECTURE if lang.moe else "Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5_moe" if lang.moe else "qwen3_5",
            "text_config": text, "vision_config": vision, "image_token_id": info.image_token_id,
            "tie_word_embeddings": lang.tie_word_embeddings}


def checkpoint_info(info: HFInfo, spec: ModelSpec, reader) -> HFInfo:
    """``info`` with the experts' layout the files hold: stacked (``HFInfo.fused_experts``: ``gate_up_proj`` /
    ``down_proj``, as the published Qwen3.5-MoE files hold them; transposed where their shapes say so, as
    Qwen3-VL-MoE's: ``qwen3_vl.hf.checkpoint_info``) or one tensor per expert (what transformers 5.23's
    ``save_pretrained`` writes: its qwen3_5_moe_text conversion splits them)."""

    if spec.language.moe is None:
        return info
    layer = spec.language.moe.moe_layers[0]
    if Names(info).llm_layer(layer)["experts"] + FUSED_EXPERTS[0] not in reader.names():
        return dataclasses.replace(info, fused_experts=False, transposed=())
    return qwen3_vit_hf.checkpoint_info(dataclasses.replace(info, fused_experts=True), spec, reader)


class Names(qwen3_vit_hf.Names):
    """Qwen3-VL's names (ViT, merger, embedding, final norm, head); an LLM layer's by its kind."""

    def llm_layer(self, i: int) -> dict[str, str]:
        names = super().llm_layer(i)
        p = f"{self.llm}layers.{i}.linear_attn."
        names.update({"linear": p, "shared": f"{self.llm}layers.{i}.mlp.shared_expert.",
                      "shared_gate": f"{self.llm}layers.{i}.mlp.shared_expert_gate.weight"})
        return names


def _norm(table, key: str, name: str, width: int) -> None:
    table.add(key, whole(table.hf(name, (width,)), (width,)))


def _mlp(table, u: str, m: dict) -> None:
    lang = table.spec.language
    H, F = lang.hidden_size, lang.ffn_hidden_size
    _norm(table, u + "mlp.linear_fc1.layer_norm_weight", m["norm2"], H)
    gate, up = table.hf(m["gate"], (F, H)), table.hf(m["up"], (F, H))
    table.add(u + "mlp.linear_fc1.weight", Recipe((2 * F, H), (Part(gate, 0, F), Part(up, 0, F))))
    table.add(u + "mlp.linear_fc2.weight", whole(table.hf(m["down"], (H, F)), (H, F)))


def moe_recipes(table, u: str, m: dict) -> None:
    """An MoE MLP (megatron-core's MoELayer): the pre-MLP norm, the router ``[E, H]``, the routed experts as our
    global ``mlp.experts.experts.linear_fc1.weight [E, 2I, H]`` (expert e: its gate rows, then its up rows) and
    ``linear_fc2.weight [E, H, I]`` -- expert e's block of HF's fused ``gate_up_proj[e]`` / ``down_proj[e]`` (their
    columns where the files hold them transposed) or its own ``experts.{e}.{gate,up,down}_proj``
    (``HFInfo.fused_experts``), so an EP rank reads only its experts --, the shared expert's ``linear_fc1``
    ``[gate | up]``, ``linear_fc2`` and its sigmoid gate ``gate_weight [1, H]``."""
    lang, info = table.spec.language, table.info
    H, moe = lang.hidden_size, lang.moe
    E, F, Fs = moe.num_experts, moe.ffn_hidden_size, moe.shared_expert_ffn_hidden_size
    _norm(table, u + "mlp.linear_fc1.layer_norm_weight", m["norm2"], H)
    table.add(u + "mlp.router.weight", whole(table.hf(m["router"], (E, H)), (E, H)))
    if info.fused_experts:
        shapes = ((E, 2 * F, H), (E, H, F))
        gate_up, down = (table.hf(m["experts"] + kind, shape[:1] + shape[:0:-1] if kind in info.transposed else shape)
                         for kind, shape in zip(FUSED_EXPERTS, shapes))
        t_gate_up, t_down = (kind in info.transposed for kind in FUSED_EXPERTS)
        fc1 = tuple(p for e in range(E) for p in (Part(gate_up, 0, F, index=e, transposed=t_gate_up),
                                                  Part(gate_up, F, 2 * F, index=e, transposed=t_gate_up)))
        fc2 = tuple(Part(down, 0, H, index=e, transposed=t_down) for e in range(E))
    else:
        per = [f"{m['experts']}{e}." for e in range(E)]
        fc1 = tuple(Part(table.hf(p + name, (F, H)), 0, F) for p in per for name in ("gate_proj.weight",
                                                                                   "up_proj.weight"))
        fc2 = tuple(Part(table.hf(p + "down_proj.weight", (H, F)), 0, H) for p in per)
    x = u + "mlp.experts.experts."
    table.add(x + "linear_fc1.weight", Recipe((E, 2 * F, H), fc1, 2 * F))
    table.add(x + "linear_fc2.weight", Recipe((E, H, F), fc2, H))
    s = m["shared"]
    gate, up = table.hf(s + "gate_proj.weight", (Fs, H)), table.hf(s + "up_proj.weight", (Fs, H))
    table.add(u + "mlp.shared_experts.linear_fc1.weight", Recipe((2 * Fs, H), (Part(gate, 0, Fs), Part(up, 0, Fs))))
    table.add(u + "mlp.shared_experts.linear_fc2.weight",
              whole(table.hf(s + "down_proj.weight", (H, Fs)), (H, Fs)))
    table.add(u + "mlp.shared_experts.gate_weight", whole(table.hf(m["shared_gate"], (1, H)), (1, H)))


def attention_layer_recipes(unit, table, mlp=_mlp) -> None:
    """A gated full-attention layer: the fused QKV per key-value group ``[q | gate | k | v]``, each query head's q
    and gate rows taken from its ``2 d`` rows of ``q_proj``."""
    lang, u = table.spec.language, unit.name + "."
    H, heads, g, d = lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.kv_channels
    per = heads // g
    m = table.names.llm_layer(unit.layer)
    q = table.hf(m["q"] + "weight", (heads * 2 * d, H))
    k, v = (table.hf(m[x] + "weight", (g * d, H)) for x in "kv")
    parts = []
    for i in range(g):
        group = range(i * per, (i + 1) * per)
        parts += [Part(q, h * 2 * d, h * 2 * d + d) for h in group]
        parts += [Part(q, h * 2 * d + d, (h + 1) * 2 * d) for h in group]
        parts += [Part(k, i * d, (i + 1) * d), Part(v, i * d, (i + 1) * d)]
    sa = u + "self_attention."
    table.add(sa + "linear_qkv.weight", Recipe(((2 * heads + 2 * g) * d, H), tuple(parts)))
    for x in "qk":
        _norm(table, sa + f"{x}_layernorm.weight", m[f"{x}_norm"], d)
    table.add(sa + "linear_proj.weight", whole(table.hf(m["o"], (H, heads * d)), (H, heads * d)))
    _norm(table, sa + "linear_qkv.layer_norm_weight", m["norm1"], H)
    mlp(table, u, m)


def linear_layer_recipes(unit, table, mlp=_mlp) -> None:
    """A Gated DeltaNet layer: in_proj and conv1d by part (q, k, v rows of HF's fused qkv; z, b, a their own),
    the per-head gates, the gated norm, the output projection, the zero-centred norms and the MLP."""
    lang, u = table.spec.language, unit.name + "."
    s, H = lang.linear_shape, lang.hidden_size
    m = table.names.llm_layer(unit.layer)
    p, sa = m["linear"], u + "self_attention."
    kd, vd, nv, w = s.key_heads * s.key_head_dim, s.value_heads * s.value_head_dim, s.value_heads, s.conv_kernel
    qkv = table.hf(p + "in_proj_qkv.weight", (s.conv_dim, H))
    conv = table.hf(p + "conv1d.weight", (s.conv_dim, 1, w))
    for name, start, width in (("q", 0, kd), ("k", kd, kd), ("v", 2 * kd, vd)):
        table.add(f"{sa}in_proj.weight.{name}", Recipe((width, H), (Part(qkv, start, start + width),)))
        table.add(f"{sa}conv1d.weight.{name}", Recipe((width, 1, w), (Part(conv, start, start + width),)))
    for name, width in (("z", vd), ("b", nv), ("a", nv)):
        table.add(f"{sa}in_proj.weight.{name}", whole(table.hf(f"{p}in_proj_{name}.weight", (width, H)), (width, H)))
    _norm(table, sa + "A_log", p + "A_log", nv)
    _norm(table, sa + "dt_bias", p + "dt_bias", nv)
    _norm(table, sa + "out_norm.weight", p + "norm.weight", s.value_head_dim)
    table.add(sa + "out_proj.weight", whole(table.hf(p + "out_proj.weight", (H, vd)), (H, vd)))
    _norm(table, u + "input_layernorm.weight", m["norm1"], H)
    mlp(table, u, m)


def linear_moe_layer_recipes(unit, table) -> None:
    """A Gated DeltaNet layer with MoE MLPs (``moe_recipes``)."""
    linear_layer_recipes(unit, table, mlp=moe_recipes)


def attention_moe_layer_recipes(unit, table) -> None:
    """A gated full-attention layer with MoE MLPs (``moe_recipes``)."""
    attention_layer_recipes(unit, table, mlp=moe_recipes)


def structure_twin(spec: ModelSpec) -> ModelSpec:
    """A tiny model with ``spec``'s structure (unit list with the same layer kinds, heads)."""

    v, lang = spec.vision, spec.language
    vision = dataclasses.replace(v, hidden_size=4 * v.num_attention_heads, ffn_hidden_size=4, num_position_embeddings=4)
    moe = lang.moe and dataclasses.replace(lang.moe, ffn_hidden_size=4, shared_expert_ffn_hidden_size=4)
    language = dataclasses.replace(lang, hidden_size=8, head_dim=8, ffn_hidden_size=4, vocab_size=128,
                                   real_vocab_size=None, mrope_section=(1, 0, 0), partial_rotary_factor=0.25,
                                   linear_key_head_dim=2, linear_value_head_dim=2, moe=moe)
    return spec.replace(vision=vision, language=language)


__all__ = ["FULL", "LINEAR", "recognizes", "is_moe", "spec_from_config", "native_config", "checkpoint_info", "Names",
           "attention_layer_recipes", "linear_layer_recipes", "attention_moe_layer_recipes", "linear_moe_layer_recipes",
           "moe_recipes", "structure_twin"]
