"""HF ``config.json`` readers: what every family's reader shares (``read_config``, ``HFInfo``, ``HFConfigError``,
``HFSide``, the padded vocabulary) and InternVL's reader (``internvl_*``). Which family reads a config is
decided in ``megatron.vlm.hf.configs`` (``spec_from_config``, ``native_config``).

Two layouts are read:

* native (``InternVLForConditionalGeneration``, ``model_type`` "internvl"): ``vision_config`` (InternViT),
  ``text_config`` (Qwen2, Qwen3 or Llama), ``downsample_ratio``, ``image_token_id``, ``vision_feature_layer``,
  ``vision_feature_select_strategy``, ``projector_hidden_act``, top-level ``tie_word_embeddings`` (what
  transformers ties by; default true);
* original OpenGVLab (``InternVLChatModel``): ``vision_config`` (InternVisionConfig: ``qkv_bias``,
  ``qk_normalization``, ``norm_type``, ``initializer_factor`` = layer-scale start), ``llm_config``
  (InternLM2, Qwen2 or Qwen3: InternVL3.5), ``select_layer``, ``ps_version``.

Everything the model here does not implement is refused with a UserError naming the config key.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from omnibal_ext.errors import UserError
from omnibal_ext.model.families.internvl import VisionSpec, vit_layers_for_feature_layer
from omnibal_ext.model.units import LanguageSpec, ModelSpec

VOCAB_MULTIPLE = 128  # padded vocabulary rows: the real size rounded up to this (Megatron's default)
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config.head_dim default (not hidden / heads)
TEXT_FAMILIES = ("llama", "qwen2", "qwen3", "internlm2")  # the text decoders ``_language`` reads


class HFConfigError(UserError):
    """A config.json this converter cannot read or whose model it does not implement."""


@dataclasses.dataclass(frozen=True)
class HFInfo:
    """What the ModelSpec does not say about an HF checkpoint."""

    layout: str  # "native" or "original"
    text_family: str  # "qwen2", "qwen3", "llama" or "internlm2"
    vit_layers_in_checkpoint: int  # HF num_hidden_layers (the spec may build fewer: vision_feature_layer)
    image_token_id: int | None  # None: not in the config (original layout: the tokenizer's <IMG_CONTEXT>)
    image_seq_length: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HFInfo":
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise HFConfigError(f"--hf-checkpoint {folder}: no config.json there (a Hugging Face model folder has "
                            "config.json and *.safetensors)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}: not valid JSON ({e})") from None


def _pair(v, key: str, where: str) -> int:
    if isinstance(v, (list, tuple)):
        if len(v) != 2 or v[0] != v[1]:
            raise HFConfigError(f"{where}: {key} {v} is not square; only square tiles and patches are implemented")
        v = v[0]
    return int(v)


def _req(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise HFConfigError(f"{where}: the key {key!r} is missing")
    return cfg[key]


def _refuse(cfg: dict, key: str, where: str, ok, what: str) -> None:
    if key in cfg and not ok(cfg[key]):
        raise HFConfigError(f"{where}: {key} = {cfg[key]!r} is not implemented ({what})")


def padded_vocab(real: int) -> int:
    return -(-real // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _rope(cfg: dict, where: str) -> tuple[int, dict | None]:
    """(rope theta, rope_scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta", 10000.0)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default"):
            raise HFConfigError(f"{where}: rope_parameters.rope_type {kind!r} is not implemented (only plain RoPE)")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind not in (None, "default"):
            raise HFConfigError(f"{where}: rope_scaling {scaling} is not implemented (only plain RoPE)")
        scaling = None
    if float(theta) != int(float(theta)):
        raise HFConfigError(f"{where}: rope_theta {theta} is not an integer (the model here takes integer bases)")
    return int(float(theta)), scaling


def _language(cfg: dict, where: str, family: str) -> LanguageSpec:
    _refuse(cfg, "hidden_act", where, lambda v: v == "silu", "only SiLU-gated MLPs")
    _refuse(cfg, "mlp_bias", where, lambda v: not v, "no MLP biases")
    _refuse(cfg, "use_sliding_window", where, lambda v: not v, "no sliding-window attention")
    if family == "llama":
        _refuse(cfg, "attention_bias", where, lambda v: not v, "Llama's attention_bias also biases o_proj")
    if family == "internlm2":
        _refuse(cfg, "bias", where, lambda v: not v, "no InternLM2 attention biases")
    if family == "qwen3":
        _refuse(cfg, "attention_bias", where, lambda v: not v, "Qwen3's attention_bias also biases o_proj")
        _refuse(cfg, "layer_types", where, lambda v: all(x == "full_attention" for x in v),
                "only full attention in every layer")
    theta, scaling = _rope(cfg, where)
    heads = int(_req(cfg, "num_attention_heads", where))
    hidden = int(_req(cfg, "hidden_size", where))
    head_dim = cfg.get("head_dim", QWEN3_HEAD_DIM if family == "qwen3" else None)  # Qwen3Config's default: 128
    real = int(_req(cfg, "vocab_size", where))
    return LanguageSpec(
        num_layers=int(_req(cfg, "num_hidden_layers", where)), hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=int(_req(cfg, "intermediate_size", where)),
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        vocab_size=padded_vocab(real), real_vocab_size=real, rotary_base=theta, rope_scaling=scaling,
        head_dim=int(head_dim) if head_dim and int(head_dim) != hidden // heads else None,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3", norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=False)  # set by the caller (where the layout keeps it)


def _none_skipped(info: "HFInfo", spec: ModelSpec, names: set[str], style: str) -> set[str]:
    return set()


def text_language_spec(cfg: dict, where: str) -> LanguageSpec:
    """The LanguageSpec of a text decoder's config (``model_type`` llama, qwen2, qwen3 or internlm2: sizes,
    ``head_dim``, ``rms_norm_eps``, ``rope_theta`` / ``rope_parameters``, qkv bias, Qwen3's per-head q/k norm,
    ``tie_word_embeddings``), for a family whose LLM is one of them."""
    family = _text_family(cfg.get("model_type"), f"{where}.model_type", TEXT_FAMILIES)
    return dataclasses.replace(_language(cfg, where, family),
                               tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))


@dataclasses.dataclass(frozen=True)
class HFSide:
    """A family's Hugging Face side (``RuntimeFamily.hf``).

    recognizes(cfg): whether a config.json is the family's; spec_from_config(cfg, name, where) -> (ModelSpec,
    HFInfo); native_config(spec, info, source) -> the config.json an export writes; names(info, style): its HF
    tensor names (the GPT decoder's: ``embed()``, ``llm_layer(i)``, ``final_norm()``, ``head``; style "legacy"
    as checkpoints hold them, "modern" the in-memory names); logits_batch(inputs, spec, info): the micro-batch of
    one sample from transformers' own inputs (``megatron.vlm.hf.logits``); structure_twin(spec): a tiny model of
    ``spec``'s structure (same units, per-layer features and checkpoint objects: ``megatron.vlm.hf.convert``);
    skipped_names(info, spec, names, style): HF tensors it leaves out on purpose (default: none)."""

    recognizes: Callable[[dict], bool]
    spec_from_config: Callable[..., "tuple[ModelSpec, HFInfo]"]
    native_config: Callable[[ModelSpec, "HFInfo", "dict | None"], dict]
    names: Callable[["HFInfo", str], object]
    logits_batch: Callable[[dict, ModelSpec, "HFInfo"], dict]
    structure_twin: Callable[[ModelSpec], ModelSpec]
    skipped_names: Callable[["HFInfo", ModelSpec, set, str], set] = _none_skipped


def internvl_recognizes(cfg: dict) -> bool:
    """InternVL: the native model_type, the original layout's ``llm_config``, or a config naming no model_type."""
    return cfg.get("model_type") in (None, "internvl", "internvl_chat") or "llm_config" in cfg


def internvl_spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of an InternVL ``config.json`` (either layout)."""
    if "llm_config" in cfg:
        return _original(cfg, name, where)
    if "text_config" in cfg and "vision_config" in cfg:
        return _native(cfg, name, where)
    raise HFConfigError(f"{where}: not an InternVL config (neither vision_config + text_config, the "
                        "InternVLForConditionalGeneration layout, nor vision_config + llm_config, the original "
                        "InternVLChatModel layout)")


def _text_family(model_type: str | None, where: str, allowed: tuple[str, ...]) -> str:
    if model_type not in allowed:
        raise HFConfigError(f"{where}: model_type {model_type!r} is not implemented (supported: {', '.join(allowed)})")
    return model_type


def _native(cfg: dict, name: str, where: str) -> tuple[ModelSpec, HFInfo]:
    v, t = cfg["vision_config"], cfg["text_config"]
    vw, tw = f"{where}: vision_config", f"{where}: text_config"
    family = _text_family(t.get("model_type"), f"{tw}.model_type", ("qwen2", "qwen3", "llama"))
    _refuse(v, "use_mean_pooling", vw, lambda x: bool(x), "use_mean_pooling false adds a final ViT LayerNorm")
    _refuse(v, "use_absolute_position_embeddings", vw, lambda x: bool(x), "only absolute position embeddings")
    _refuse(v, "use_mask_token", vw, lambda x: not x, "no mask token")
    _refuse(v, "hidden_act", vw, lambda x: x == "gelu", "only GELU in the ViT MLP")
    _refuse(v, "num_channels", vw, lambda x: int(x) == 3, "RGB tiles only")
    _refuse(cfg, "projector_hidden_act", where, lambda x: x == "gelu", "only a GELU projector")
    _refuse(cfg, "vision_feature_select_strategy", where, lambda x: x == "default",
            "only 'default' (the class token is dropped)")
    norm = v.get("norm_type", "layer_norm")
    if norm not in ("layer_norm", "rms_norm"):
        raise HFConfigError(f"{vw}: norm_type {norm!r} is not implemented (layer_norm or rms_norm)")
    feature = cfg.get("vision_feature_layer", -1)
    if not isinstance(feature, int):
        raise HFConfigError(f"{where}: vision_feature_layer {feature!r}: only one layer (an integer) is implemented")
    n_vit = int(_req(v, "num_hidden_layers", vw))
    try:
        built = vit_layers_for_feature_layer(n_vit, feature)
    except UserError as e:
        raise HFConfigError(f"{where}: vision_feature_layer: {e}") from None
    lang = dataclasses.replace(_language(t, tw, family), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    vision = VisionSpec(
        num_layers=built, hidden_size=int(_req(v, "hidden_size", vw)),
        num_attention_heads=int(_req(v, "num_attention_heads", vw)),
        ffn_hidden_size=int(_req(v, "intermediate_size", vw)),
        image_size=_pair(v.get("image_size", 448), "image_size", vw),
        patch_size=_pair(v.get("patch_size", 14), "patch_size", vw),
        normalization="LayerNorm" if norm == "layer_norm" else "RMSNorm",
        norm_eps=float(v.get("layer_norm_eps", 1e-6)), qkv_bias=bool(v.get("attention_bias", False)),
        qk_norm=bool(v.get("use_qk_norm", False)), layer_scale_init=float(v.get("layer_scale_init_value", 0.1)))
    spec = ModelSpec(name=name, vision=vision, language=lang, downsample_ratio=float(cfg.get("downsample_ratio", 0.5)))
    _check_shuffle(spec, where)
    info = HFInfo("native", family, n_vit, cfg.get("image_token_id"), cfg.get("image_seq_length"))
    return spec, info


def _original(cfg: dict, name: str, where: str) -> tuple[ModelSpec, HFInfo]:
    v, t = cfg["vision_config"], cfg["llm_config"]
    vw, tw = f"{where}: vision_config", f"{where}: llm_config"
    family = _text_family(t.get("model_type"), f"{tw}.model_type", ("internlm2", "qwen2", "qwen3"))
    _refuse(cfg, "ps_version", where, lambda x: x == "v2", "only pixel shuffle v2")
    _refuse(v, "hidden_act", vw, lambda x: x == "gelu", "only GELU in the ViT MLP")
    _refuse(v, "num_channels", vw, lambda x: int(x) == 3, "RGB tiles only")
    norm = v.get("norm_type", "rms_norm")
    if norm not in ("layer_norm", "rms_norm"):
        raise HFConfigError(f"{vw}: norm_type {norm!r} is not implemented (layer_norm or rms_norm)")
    feature = cfg.get("select_layer", -1)
    n_vit = int(_req(v, "num_hidden_layers", vw))
    try:
        built = vit_layers_for_feature_layer(n_vit, int(feature))
    except UserError as e:
        raise HFConfigError(f"{where}: select_layer: {e}") from None
    image_size = cfg.get("force_image_size") or v.get("image_size", 448)
    lang = dataclasses.replace(_language(t, tw, family), tie_word_embeddings=bool(t.get("tie_word_embeddings", False)))
    vision = VisionSpec(
        num_layers=built, hidden_size=int(_req(v, "hidden_size", vw)),
        num_attention_heads=int(_req(v, "num_attention_heads", vw)),
        ffn_hidden_size=int(_req(v, "intermediate_size", vw)),
        image_size=_pair(image_size, "image_size", vw), patch_size=_pair(v.get("patch_size", 14), "patch_size", vw),
        normalization="LayerNorm" if norm == "layer_norm" else "RMSNorm",
        norm_eps=float(v.get("layer_norm_eps", 1e-6)), qkv_bias=bool(v.get("qkv_bias", False)),
        qk_norm=bool(v.get("qk_normalization", False)), layer_scale_init=float(v.get("initializer_factor", 1.0)))
    spec = ModelSpec(name=name, vision=vision, language=lang, downsample_ratio=float(cfg.get("downsample_ratio", 0.5)))
    _check_shuffle(spec, where)
    return spec, HFInfo("original", family, n_vit, cfg.get("image_token_id"), None)


def _check_shuffle(spec: ModelSpec, where: str) -> None:
    r = spec.downsample_ratio
    if r <= 0 or abs(1 / r - round(1 / r)) > 1e-9:
        raise HFConfigError(f"{where}: downsample_ratio {r}: only 1/k is implemented")
    grid = spec.vision.image_size // spec.vision.patch_size
    if spec.vision.image_size % spec.vision.patch_size or grid % round(1 / r):
        raise HFConfigError(f"{where}: image_size {spec.vision.image_size} / patch_size {spec.vision.patch_size} "
                            f"gives a patch grid that downsample_ratio {r} cannot pixel-shuffle")


def internvl_native_config(spec: ModelSpec, info: HFInfo, source: dict | None) -> dict:
    """A native ``InternVLForConditionalGeneration`` config.json for ``spec``.

    ``source``: the imported config.json when it was native (kept as it is: every key it had, so that an
    import -> export round trip writes the same file); otherwise one is written from the spec (InternLM2
    becomes Llama, as transformers' own conversion does)."""
    if source is not None and info.layout == "native":
        return json.loads(json.dumps(source))
    v, lang = spec.vision, spec.language
    family = "llama" if info.text_family == "internlm2" else info.text_family
    text = {"model_type": family, "hidden_size": lang.hidden_size, "num_hidden_layers": lang.num_layers,
            "num_attention_heads": lang.num_attention_heads, "num_key_value_heads": lang.kv_groups,
            "intermediate_size": lang.ffn_hidden_size, "vocab_size": lang.vocab_real, "hidden_act": "silu",
            "rms_norm_eps": lang.norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": float(lang.rotary_base)},
            "tie_word_embeddings": lang.tie_word_embeddings, "head_dim": lang.kv_channels}
    if family in ("llama", "qwen3"):
        text.update(attention_bias=False)
    if family == "llama":
        text.update(mlp_bias=False)
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
