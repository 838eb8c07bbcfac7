"""InternVL's Hugging Face side: ``config.json`` -> ModelSpec (+ HFInfo) and back, tensor names (native
``InternVLForConditionalGeneration`` and original OpenGVLab ``InternVLChatModel`` layouts) and the mapping of its
own units (ViT embedding, ViT layers, projector) to our global tensors; the GPT decoder's units map through
``megatron.vlm.hf.recipes``, its config through ``megatron.vlm.hf.text_configs``.

Two config layouts are read:

* native (``InternVLForConditionalGeneration``, ``model_type`` "internvl"): ``vision_config`` (InternViT),
  ``text_config`` (Qwen2, Qwen3, Qwen3-MoE or Llama), ``downsample_ratio``, ``image_token_id``,
  ``vision_feature_layer``,
  ``vision_feature_select_strategy``, ``projector_hidden_act``, top-level ``tie_word_embeddings`` (what
  transformers ties by; default true);
* original OpenGVLab (``InternVLChatModel``): ``vision_config`` (InternVisionConfig: ``qkv_bias``,
  ``qk_normalization``, ``norm_type``, ``initializer_factor`` = layer-scale start), ``llm_config``
  (InternLM2, Qwen2, Qwen3 or Qwen3-MoE: InternVL3.5), ``select_layer``, ``ps_version``.

Everything the model here does not implement is refused with a UserError naming the config key.
"""
from __future__ import annotations

import dataclasses
import json

import torch

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import ModelSpec, vit_layers_for_feature_layer

from .costs import NAME, VisionSpec
from megatron.vlm.data.collate import collate_padded
from megatron.vlm.hf.config import HFConfigError, HFInfo, refuse, require, square
from megatron.vlm.hf.recipes import Part, Recipe, whole
from megatron.vlm.hf.text_configs import READERS, embed_name, layer_names, text_config, text_family, with_tie
from megatron.vlm.stage.micro_batch import MicroBatch


def recognizes(cfg: dict) -> bool:
    """InternVL: the native model_type, the original layout's ``llm_config``, or a config naming no model_type."""
    return cfg.get("model_type") in (None, "internvl", "internvl_chat") or "llm_config" in cfg


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of an InternVL ``config.json`` (either layout)."""
    if "llm_config" in cfg:
        return _original(cfg, name, where)
    if "text_config" in cfg and "vision_config" in cfg:
        return _native(cfg, name, where)
    raise HFConfigError(f"{where}: not an InternVL config (neither vision_config + text_config, the "
                        "InternVLForConditionalGeneration layout, nor vision_config + llm_config, the original "
                        "InternVLChatModel layout)")


def _native(cfg: dict, name: str, where: str) -> tuple[ModelSpec, HFInfo]:
    v, t = cfg["vision_config"], cfg["text_config"]
    vw, tw = f"{where}: vision_config", f"{where}: text_config"
    family = text_family(t.get("model_type"), f"{tw}.model_type", ("qwen2", "qwen3", "qwen3_moe", "llama"))
    refuse(v, "use_mean_pooling", vw, lambda x: bool(x), "use_mean_pooling false adds a final ViT LayerNorm")
    refuse(v, "use_absolute_position_embeddings", vw, lambda x: bool(x), "only absolute position embeddings")
    refuse(v, "use_mask_token", vw, lambda x: not x, "no mask token")
    refuse(v, "hidden_act", vw, lambda x: x == "gelu", "only GELU in the ViT MLP")
    refuse(v, "num_channels", vw, lambda x: int(x) == 3, "RGB tiles only")
    refuse(cfg, "projector_hidden_act", where, lambda x: x == "gelu", "only a GELU projector")
    refuse(cfg, "vision_feature_select_strategy", where, lambda x: x == "default",
            "only 'default' (the class token is dropped)")
    norm = v.get("norm_type", "layer_norm")
    if norm not in ("layer_norm", "rms_norm"):
        raise HFConfigError(f"{vw}: norm_type {norm!r} is not implemented (layer_norm or rms_norm)")
    feature = cfg.get("vision_feature_layer", -1)
    if not isinstance(feature, int):
        raise HFConfigError(f"{where}: vision_feature_layer {feature!r}: only one layer (an integer) is implemented")
    n_vit = int(require(v, "num_hidden_layers", vw))
    try:
        built = vit_layers_for_feature_layer(n_vit, feature)
    except UserError as e:
        raise HFConfigError(f"{where}: vision_feature_layer: {e}") from None
    lang = with_tie(READERS[family](t, tw), cfg.get("tie_word_embeddings", True))
    vision = _vision(v, vw, built, v.get("image_size", 448), norm, qkv_bias=bool(v.get("attention_bias", False)),
                     qk_norm=bool(v.get("use_qk_norm", False)),
                     layer_scale_init=float(v.get("layer_scale_init_value", 0.1)))
    spec = _spec(cfg, name, vision, lang, where)
    info = HFInfo("native", family, n_vit, cfg.get("image_token_id"), cfg.get("image_seq_length"))
    return spec, info


def _original(cfg: dict, name: str, where: str) -> tuple[ModelSpec, HFInfo]:
    v, t = cfg["vision_config"], cfg["llm_config"]
    vw, tw = f"{where}: vision_config", f"{where}: llm_config"
    family = text_family(t.get("model_type"), f"{tw}.model_type", ("internlm2", "qwen2", "qwen3", "qwen3_moe"))
    refuse(cfg, "ps_version", where, lambda x: x == "v2", "only pixel shuffle v2")
    refuse(v, "hidden_act", vw, lambda x: x == "gelu", "only GELU in the ViT MLP")
    refuse(v, "num_channels", vw, lambda x: int(x) == 3, "RGB tiles only")
    norm = v.get("norm_type", "rms_norm")
    if norm not in ("layer_norm", "rms_norm"):
        raise HFConfigError(f"{vw}: norm_type {norm!r} is not implemented (layer_norm or rms_norm)")
    feature = cfg.get("select_layer", -1)
    n_vit = int(require(v, "num_hidden_layers", vw))
    try:
        built = vit_layers_for_feature_layer(n_vit, int(feature))
    except UserError as e:
        raise HFConfigError(f"{where}: select_layer: {e}") from None
    image_size = cfg.get("force_image_size") or v.get("image_size", 448)
    lang = with_tie(READERS[family](t, tw), t.get("tie_word_embeddings", False))
    vision = _vision(v, vw, built, image_size, norm, qkv_bias=bool(v.get("qkv_bias", False)),
                     qk_norm=bool(v.get("qk_normalization", False)),
                     layer_scale_init=float(v.get("initializer_factor", 1.0)))
    spec = _spec(cfg, name, vision, lang, where)
    return spec, HFInfo("original", family, n_vit, cfg.get("image_token_id"), None)


def _vision(v: dict, vw: str, built: int, image_size, norm: str, **layout_fields) -> VisionSpec:
    """The InternViT of ``vision_config`` ``v`` (either layout; ``layout_fields``: what the two name apart)."""
    return VisionSpec(
        num_layers=built, hidden_size=int(require(v, "hidden_size", vw)),
        num_attention_heads=int(require(v, "num_attention_heads", vw)),
        ffn_hidden_size=int(require(v, "intermediate_size", vw)),
        image_size=square(image_size, "image_size", vw), patch_size=square(v.get("patch_size", 14), "patch_size", vw),
        normalization="LayerNorm" if norm == "layer_norm" else "RMSNorm",
        norm_eps=float(v.get("layer_norm_eps", 1e-6)), **layout_fields)


def _spec(cfg: dict, name: str, vision: VisionSpec, lang, where: str) -> ModelSpec:
    spec = ModelSpec(name=name, vision=vision, language=lang, downsample_ratio=float(cfg.get("downsample_ratio", 0.5)),
                     family=NAME)
    _check_shuffle(spec, where)
    return spec


def _check_shuffle(spec: ModelSpec, where: str) -> None:
    r = spec.downsample_ratio
    if r <= 0 or abs(1 / r - round(1 / r)) > 1e-9:
        raise HFConfigError(f"{where}: downsample_ratio {r}: only 1/k is implemented")
    grid = spec.vision.image_size // spec.vision.patch_size
    if spec.vision.image_size % spec.vision.patch_size or grid % round(1 / r):
        raise HFConfigError(f"{where}: image_size {spec.vision.image_size} / patch_size {spec.vision.patch_size} "
                            f"gives a patch grid that downsample_ratio {r} cannot pixel-shuffle")


def native_config(spec: ModelSpec, info: HFInfo, source: dict | None) -> dict:
    """A native ``InternVLForConditionalGeneration`` config.json for ``spec``.

    ``source``: the imported config.json when it was native (kept as it is: every key it had, so that an
    import -> export round trip writes the same file); otherwise one is written from the spec (InternLM2
    becomes Llama, as transformers' own conversion does)."""
    if source is not None and info.layout == "native":
        return json.loads(json.dumps(source))
    v, lang = spec.vision, spec.language
    text = text_config(lang, info.text_family)
    vision = {"model_type": "internvl_vision", "hidden_size": v.hidden_size, "num_hidden_layers": v.num_layers,
              "num_attention_heads": v.num_attention_heads, "intermediate_size": v.ffn_hidden_size,
              "image_size": [v.image_size, v.image_size], "patch_size": [v.patch_size, v.patch_size],
              "attention_bias": v.qkv_bias, "use_qk_norm": v.qk_norm,
              "norm_type": "layer_norm" if v.normalization == "LayerNorm" else "rms_norm",
              "layer_norm_eps": v.norm_eps, "layer_scale_init_value": v.layer_scale_init or 0.0,
              "use_mean_pooling": True, "use_absolute_position_embeddings": True, "hidden_act": "gelu"}
    return {"architectures": ["InternVLForConditionalGeneration"], "model_type": "internvl",
            "vision_config": vision, "text_config": text, "downsample_ratio": spec.downsample_ratio,
            "image_token_id": info.image_token_id, "image_seq_length": spec.tokens_per_tile,
            "vision_feature_layer": -1, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
            "tie_word_embeddings": lang.tie_word_embeddings}


class Names:
    """HF tensor names of one layout (``style``: "legacy" = ``vision_tower.`` / ``language_model.model.`` /
    ``language_model.lm_head`` as save_pretrained writes them; "modern" = ``model.vision_tower.`` /
    ``model.language_model.`` / ``lm_head``, the in-memory names)."""

    def __init__(self, info: HFInfo, style: str = "legacy"):
        self.info, self.style = info, style
        if info.layout == "native":
            p = "model." if style == "modern" else ""
            self.vit = f"{p}vision_tower."
            self.proj = f"{p}multi_modal_projector."
            self.llm = f"{p}language_model." if style == "modern" else "language_model.model."
            self.head = "lm_head.weight" if style == "modern" else "language_model.lm_head.weight"
        else:
            self.vit, self.proj, self.llm = "vision_model.", "mlp1.", "language_model.model."
            self.head = "language_model.output.weight" if info.text_family == "internlm2" else "language_model.lm_head.weight"

    # ViT -------------------------------------------------------------------------------------------
    def vit_embed(self) -> dict[str, str]:
        e = self.vit + "embeddings."
        if self.info.layout == "native":
            return {"cls_token": e + "cls_token", "position": e + "position_embeddings",
                    "patch.weight": e + "patch_embeddings.projection.weight",
                    "patch.bias": e + "patch_embeddings.projection.bias"}
        return {"cls_token": e + "class_embedding", "position": e + "position_embedding",
                "patch.weight": e + "patch_embedding.weight", "patch.bias": e + "patch_embedding.bias"}

    def vit_layer(self, i: int) -> dict[str, str]:
        if self.info.layout == "native":
            p = f"{self.vit}encoder.layer.{i}."
            return {"q": p + "attention.q_proj.", "k": p + "attention.k_proj.", "v": p + "attention.v_proj.",
                    "q_norm": p + "attention.q_norm.weight", "k_norm": p + "attention.k_norm.weight",
                    "proj": p + "attention.projection_layer.", "ls1": p + "lambda_1", "ls2": p + "lambda_2",
                    "norm1": p + "layernorm_before.", "norm2": p + "layernorm_after.",
                    "fc1": p + "mlp.fc1.", "fc2": p + "mlp.fc2.", "prefix": p}
        p = f"{self.vit}encoder.layers.{i}."
        return {"qkv": p + "attn.qkv.", "q_norm": p + "attn.q_norm.weight", "k_norm": p + "attn.k_norm.weight",
                "proj": p + "attn.proj.", "ls1": p + "ls1", "ls2": p + "ls2", "norm1": p + "norm1.",
                "norm2": p + "norm2.", "fc1": p + "mlp.fc1.", "fc2": p + "mlp.fc2.", "prefix": p}

    def projector(self) -> dict[str, str]:
        if self.info.layout == "native":
            return {"norm": self.proj + "layer_norm.", "fc1": self.proj + "linear_1.", "fc2": self.proj + "linear_2."}
        return {"norm": self.proj + "0.", "fc1": self.proj + "1.", "fc2": self.proj + "3."}

    # LLM -------------------------------------------------------------------------------------------
    def embed(self) -> str:
        return embed_name(self.llm, self.info.text_family)

    def llm_layer(self, i: int) -> dict[str, str]:
        return layer_names(f"{self.llm}layers.{i}.", self.info.text_family)

    def final_norm(self) -> str:
        return self.llm + "norm.weight"


def skipped_names(info: HFInfo, spec, names: set[str], style: str) -> set[str]:
    """HF tensors legitimately left out: ViT layers after the one ``vision_feature_layer`` selects."""
    n = Names(info, style)
    prefixes = tuple(n.vit_layer(i)["prefix"] for i in range(spec.vision.num_layers, info.vit_layers_in_checkpoint))
    return {x for x in names if prefixes and x.startswith(prefixes)}


def vision_embed_recipes(unit, table) -> None:
    v, hf, add, u = table.spec.vision, table.hf, table.add, unit.name + "."
    H = v.hidden_size
    e = table.names.vit_embed()
    P = v.seq_per_tile
    add(u + "cls_token", whole(hf(e["cls_token"], (1, 1, H)), (1, 1, H)))
    add(u + "position", whole(hf(e["position"], (1, P, H)), (1, P, H)))
    ps = (H, 3, v.patch_size, v.patch_size)
    add(u + "patch.weight", whole(hf(e["patch.weight"], ps), ps))
    add(u + "patch.bias", whole(hf(e["patch.bias"], (H,)), (H,)))


def vision_layer_recipes(unit, table) -> None:
    """ViT attention per real head (our global tensors: megatron/vlm/hf/keys.py's docstring)."""
    v, hf, add, u, info = table.spec.vision, table.hf, table.add, unit.name + ".", table.info
    H, R, d, Fv = v.hidden_size, v.num_attention_heads, v.head_dim, v.ffn_hidden_size
    m = table.names.vit_layer(unit.layer)
    sa = u + "self_attention."
    if info.layout == "native":
        src = [(hf(m[x] + "weight", (H, H)), 0) for x in "qkv"]  # (name, first row of the H-row block)
        bsrc = [(hf(m[x] + "bias", (H,)), 0) for x in "qkv"] if v.qkv_bias else None
    else:
        qkv = hf(m["qkv"] + "weight", (3 * H, H))
        src = [(qkv, j * H) for j in range(3)]
        bsrc = [(hf(m["qkv"] + "bias", (3 * H,)), j * H) for j in range(3)] if v.qkv_bias else None
    per_head = lambda s: tuple(Part(name, r0 + h * d, r0 + (h + 1) * d) for h in range(R) for name, r0 in s)  # noqa: E731
    add(sa + "linear_qkv.weight", Recipe((R, 3 * d, H), per_head(src), 3 * d))
    if bsrc:
        add(sa + "linear_qkv.bias", Recipe((R, 3 * d), per_head(bsrc), 3 * d))
    proj = hf(m["proj"] + "weight", (H, H))
    add(sa + "linear_proj.weight", Recipe((R, H, d), tuple(Part(proj, 0, H, (h * d, (h + 1) * d)) for h in range(R)), H))
    add(sa + "linear_proj.bias", whole(hf(m["proj"] + "bias", (H,)), (H,)))
    if v.qk_norm:
        for x in "qk":
            name = hf(m[f"{x}_norm"], (H,))
            add(sa + f"{x}_layernorm.weight", Recipe((R, d), tuple(Part(name, h * d, (h + 1) * d) for h in range(R)), d))
    norms = ("weight", "bias") if v.normalization == "LayerNorm" else ("weight",)
    for w in norms:
        add(sa + f"linear_qkv.layer_norm_{w}", whole(hf(m["norm1"] + w, (H,)), (H,)))
        add(u + f"mlp.linear_fc1.layer_norm_{w}", whole(hf(m["norm2"] + w, (H,)), (H,)))
    add(u + "mlp.linear_fc1.weight", whole(hf(m["fc1"] + "weight", (Fv, H)), (Fv, H)))
    add(u + "mlp.linear_fc1.bias", whole(hf(m["fc1"] + "bias", (Fv,)), (Fv,)))
    add(u + "mlp.linear_fc2.weight", whole(hf(m["fc2"] + "weight", (H, Fv)), (H, Fv)))
    add(u + "mlp.linear_fc2.bias", whole(hf(m["fc2"] + "bias", (H,)), (H,)))
    add(u + "self_attn_bda.scale", whole(hf(m["ls1"], (H,)), (H,)))
    add(u + "mlp_bda.scale", whole(hf(m["ls2"], (H,)), (H,)))


def projector_recipes(unit, table) -> None:
    hf, add, u = table.hf, table.add, unit.name + "."
    m = table.names.projector()
    Pin, Hl = table.spec.projector_in_size, table.spec.language.hidden_size
    for w in ("weight", "bias"):
        add(u + f"norm.{w}", whole(hf(m["norm"] + w, (Pin,)), (Pin,)))
    add(u + "fc1.weight", whole(hf(m["fc1"] + "weight", (Hl, Pin)), (Hl, Pin)))
    add(u + "fc1.bias", whole(hf(m["fc1"] + "bias", (Hl,)), (Hl,)))
    add(u + "fc2.weight", whole(hf(m["fc2"] + "weight", (Hl, Hl)), (Hl, Hl)))
    add(u + "fc2.bias", whole(hf(m["fc2"] + "bias", (Hl,)), (Hl,)))


def logits_batch(inputs: dict, spec, info):
    """The micro-batch of one sample from transformers' inputs (``input_ids [1, s]`` already holding
    ``image_seq_length`` image-token ids per tile, ``pixel_values [tiles, 3, H, W]``; ``attention_mask`` all ones),
    as the collate makes it; any other input (video: frames are tiles here) is refused, never ignored."""


    unknown = sorted(set(inputs) - {"input_ids", "pixel_values", "attention_mask"})
    if unknown:
        raise UserError(f"inputs {unknown}: not implemented for InternVL (it takes input_ids, pixel_values; a "
                        "video's frames are tiles in pixel_values)")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise UserError("attention_mask with zeros (padding) is not implemented: give one unpadded sample")


    ids = inputs["input_ids"].reshape(-1).to(torch.int64)
    pixels = inputs["pixel_values"].to(torch.float32)
    sample = {"input_ids": ids.numpy(), "labels": torch.zeros_like(ids).numpy(), "pixel_values": pixels,
              "image_flags": torch.ones(len(pixels), dtype=torch.int64)}
    return MicroBatch.of(collate_padded([sample], pad_id=0))


def structure_twin(spec):
    """A tiny model with ``spec``'s structure (unit list, per-layer features, heads)."""

    v, lang = spec.vision, spec.language
    f = int(round(1 / spec.downsample_ratio))
    vision = dataclasses.replace(v, hidden_size=2 * v.num_attention_heads, ffn_hidden_size=4, image_size=f, patch_size=1)
    moe = lang.moe and dataclasses.replace(lang.moe, ffn_hidden_size=4)
    language = dataclasses.replace(lang, hidden_size=8, head_dim=2, ffn_hidden_size=4, vocab_size=128,
                                   real_vocab_size=None, moe=moe)
    return spec.replace(vision=vision, language=language)
