"""The Qwen3-VL ViT's Hugging Face side (used by the Qwen families with that ViT): its config reader
(``vision_spec``), tensor names (``Names``), tensor recipes of the patch embedding, the layers and the (DeepStack)
mergers, and the fused-expert layout of the Qwen3 MoE decoders' files (``checkpoint_info``).
"""
from __future__ import annotations

import dataclasses

from omnibal_ext.model.spec import ModelSpec

from megatron.vlm.hf.config import HFConfigError, HFInfo, refuse, square
from megatron.vlm.hf.recipes import whole
from megatron.vlm.lineages.qwen.hf import vit_attention_recipes
from megatron.vlm.lineages.qwen.vision_costs import VisionSpec

FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # an MoE layer's stacked expert tensors (mlp.experts.<name>)


VISION_DEFAULTS = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, num_position_embeddings=2304,
                       deepstack_visual_indexes=(8, 16, 24), patch_size=16, temporal_patch_size=2, in_channels=3,
                       spatial_merge_size=2)  # transformers' Qwen3VLVisionConfig defaults


def vision_spec(v: dict, where: str, llm_hidden: int) -> VisionSpec:
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


def checkpoint_info(info: HFInfo, spec: ModelSpec, reader) -> HFInfo:
    """``info`` with the fused expert tensors the files hold transposed (``HFInfo.transposed``): each kind as its
    first MoE layer's shape says (the in-memory shape: not transposed, as transformers decides)."""

    lang = spec.language
    if lang.moe is None:
        return info
    names = Names(info)
    layer = lang.moe.moe_layers[0]
    transposed = []
    for kind, shape in zip(FUSED_EXPERTS, fused_shapes(spec)):
        name = names.llm_layer(layer)["experts"] + kind
        if name in reader.names() and tuple(reader.shape(name)) != shape:
            transposed.append(kind)
    return dataclasses.replace(info, transposed=tuple(transposed))


def fused_shapes(spec: ModelSpec) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The in-memory shapes of ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    lang = spec.language
    E, F, H = lang.moe.num_experts, lang.moe.ffn_hidden_size, lang.hidden_size
    return (E, 2 * F, H), (E, H, F)


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


def deepstack_layer_recipes(unit, table) -> None:
    """A ViT layer at a DeepStack index: the layer's tensors and its DeepStack merger's."""
    vision_layer_recipes(unit, table)
    deepstack_merger_recipes(unit, table)
