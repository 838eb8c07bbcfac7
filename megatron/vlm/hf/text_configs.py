"""The text decoders' ``config.json`` readers, shared by every family whose LLM is one of them: a function per text
``model_type`` (``READERS``) giving the ``LanguageSpec``, ``text_config``, its inverse for export, and the
decoder's HF tensor names (``embed_name``, ``layer_names``).

A family's reader picks the decoder's config (``text_config``, ``llm_config``, or the top level of a flat config)
and calls ``language_spec`` (or one reader of ``READERS``); it sets what the layout keeps elsewhere
(``tie_word_embeddings``) itself. What the decoder here does not implement is refused with an ``HFConfigError``
naming the key.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from omnibal_ext.errors import UserError
from omnibal_ext.model.moe import MoESpec, layer_freq_from_qwen
from omnibal_ext.model.spec import LanguageSpec

from .config import HFConfigError, padded_vocab, refuse, require


def rope(cfg: dict, where: str, default_theta: float = 10000.0, kinds: tuple = ("default",)) -> tuple[int, dict]:
    """(integer rope theta, the rope parameters) from ``rope_parameters`` (transformers 5) and/or ``rope_theta`` +
    ``rope_scaling`` (4.x): the two dicts merged, each of a type in ``kinds`` (a missing type: plain RoPE)."""
    theta = cfg.get("rope_theta", default_theta)
    merged: dict = {}
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise HFConfigError(f"{where}: {key} {params!r} is not implemented")
        kind = params.get("rope_type", params.get("type"))
        if kind not in (None, *kinds):
            raise HFConfigError(f"{where}: {key} type {kind!r} is not implemented (only {', '.join(kinds)} RoPE)")
        theta = params.get("rope_theta", theta)
        merged.update(params)
    if float(theta) != int(float(theta)):
        raise HFConfigError(f"{where}: rope_theta {theta} is not an integer (the model here takes integer bases)")
    return int(float(theta)), merged


def decoder(cfg: dict, where: str, *, qkv_bias: bool, default_theta: float = 10000.0, rope_kinds=("default",),
            **fields) -> LanguageSpec:
    """The LanguageSpec of a Llama-like decoder config (RMSNorm, SwiGLU, grouped-query attention, RoPE): sizes,
    ``head_dim``, ``rms_norm_eps``, ``rope_theta``; ``fields`` are further LanguageSpec fields (``mrope_section``).
    ``tie_word_embeddings`` is False: the caller sets it where its layout keeps it."""
    refuse(cfg, "hidden_act", where, lambda v: v == "silu", "only SiLU-gated MLPs")
    refuse(cfg, "mlp_bias", where, lambda v: not v, "no MLP biases")
    refuse(cfg, "use_sliding_window", where, lambda v: not v, "no sliding-window attention")
    theta, _ = rope(cfg, where, default_theta, rope_kinds)
    heads = int(require(cfg, "num_attention_heads", where))
    hidden = int(require(cfg, "hidden_size", where))
    head_dim = cfg.get("head_dim")
    real = int(require(cfg, "vocab_size", where))
    try:
        return LanguageSpec(
            num_layers=int(require(cfg, "num_hidden_layers", where)), hidden_size=hidden, num_attention_heads=heads,
            ffn_hidden_size=int(require(cfg, "intermediate_size", where)),
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            vocab_size=padded_vocab(real), real_vocab_size=real, rotary_base=theta,
            head_dim=int(head_dim) if head_dim and int(head_dim) != hidden // heads else None,
            qkv_bias=qkv_bias, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_word_embeddings=False, **fields)
    except HFConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the spec's own checks (mrope_section, vocabulary) name the problem
        raise HFConfigError(f"{where}: {e}") from None


def llama(cfg: dict, where: str, **kw) -> LanguageSpec:
    """Llama (no biases)."""
    refuse(cfg, "attention_bias", where, lambda v: not v, "Llama's attention_bias also biases o_proj")
    return decoder(cfg, where, qkv_bias=False, **kw)


def qwen2(cfg: dict, where: str, **kw) -> LanguageSpec:
    """Qwen2 (biases on q, k, v)."""
    return decoder(cfg, where, qkv_bias=True, **kw)


def internlm2(cfg: dict, where: str, **kw) -> LanguageSpec:
    """InternLM2 (fused ``wqkv``, no biases)."""
    refuse(cfg, "bias", where, lambda v: not v, "no InternLM2 attention biases")
    return decoder(cfg, where, qkv_bias=False, **kw)


QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config.head_dim default (not hidden / heads)


def qwen3(cfg: dict, where: str, **kw) -> LanguageSpec:
    """Qwen3 (no biases, per-head q/k RMSNorm, ``head_dim`` 128 unless given)."""
    refuse(cfg, "attention_bias", where, lambda v: not v, "Qwen3's attention_bias also biases o_proj")
    refuse(cfg, "layer_types", where, lambda v: all(x == "full_attention" for x in v),
           "only full attention in every layer")
    cfg = cfg if cfg.get("head_dim") else {**cfg, "head_dim": QWEN3_HEAD_DIM}
    return decoder(cfg, where, qkv_bias=False, qk_norm=True, **kw)


def qwen_experts(cfg: dict, where: str, norm_topk_prob_default: bool | None) -> MoESpec:
    """The MoESpec of a Qwen MoE text config: ``num_experts`` (transformers 5 writes ``num_local_experts``),
    ``num_experts_per_tok``, ``moe_intermediate_size``, the MoE layers by Qwen's rule (``decoder_sparse_step``,
    default 1, and ``mlp_only_layers``), softmax routing, no shared expert. ``norm_topk_prob_default``: the config
    class's default when the key is missing (Qwen3-MoE: False); None: the model always renormalises the top k
    (a VLM's MoE decoder), and a config saying otherwise is refused. ``router_aux_loss_coef`` is a training choice
    (``--moe-aux-loss-coeff``), not part of the model."""
    refuse(cfg, "shared_expert_intermediate_size", where, lambda v: not v, "no shared experts")
    refuse(cfg, "router_aux_loss_coef", where, lambda v: float(v) >= 0, "a coefficient >= 0")
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise HFConfigError(f"{where}: the key 'num_experts' is missing")
    layers = int(require(cfg, "num_hidden_layers", where))
    if norm_topk_prob_default is None:
        refuse(cfg, "norm_topk_prob", where, lambda v: bool(v), "this model always renormalises its top-k weights")
        norm = True
    else:
        norm = bool(cfg.get("norm_topk_prob", norm_topk_prob_default))
    try:
        freq = layer_freq_from_qwen(layers, int(cfg.get("decoder_sparse_step") or 1), cfg.get("mlp_only_layers") or ())
        return MoESpec(num_experts=int(experts), topk=int(require(cfg, "num_experts_per_tok", where)),
                       ffn_hidden_size=int(require(cfg, "moe_intermediate_size", where)), layer_freq=freq,
                       norm_topk_prob=norm, score_function="softmax")
    except UserError as e:
        if isinstance(e, HFConfigError):
            raise
        raise HFConfigError(f"{where}: {e}") from None


QWEN3_MOE_NORM_TOPK_DEFAULT = False  # transformers' Qwen3MoeConfig.norm_topk_prob default


def qwen3_moe(cfg: dict, where: str, **kw) -> LanguageSpec:
    """Qwen3-MoE: Qwen3's attention, MoE MLPs (``qwen_experts``; ``norm_topk_prob`` False unless given) where Qwen's
    rule puts them, dense ``intermediate_size`` MLPs elsewhere."""
    moe = kw.pop("moe", None) or qwen_experts(cfg, where, QWEN3_MOE_NORM_TOPK_DEFAULT)
    return qwen3(cfg, where, moe=moe, **kw)


READERS: dict[str, Callable[..., LanguageSpec]] = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3,
                                                   "qwen3_moe": qwen3_moe, "internlm2": internlm2}


def text_family(model_type: str | None, where: str, allowed: tuple[str, ...] = tuple(READERS)) -> str:
    """``model_type`` when it is one of ``allowed``, else an HFConfigError naming ``where``."""
    if model_type not in allowed:
        raise HFConfigError(f"{where}: model_type {model_type!r} is not implemented (supported: {', '.join(allowed)})")
    return model_type


def language_spec(cfg: dict, where: str, allowed: tuple[str, ...] = tuple(READERS)) -> tuple[str, LanguageSpec]:
    """(model_type, LanguageSpec) of a text decoder's config whose ``model_type`` is one of ``allowed``."""
    family = text_family(cfg.get("model_type"), f"{where}.model_type", allowed)
    return family, READERS[family](cfg, where)


def text_config(lang: LanguageSpec, model_type: str) -> dict:
    """The text decoder's config.json part of ``lang`` for ``model_type`` (a key of ``READERS``; InternLM2 is
    written as Llama, as transformers' own conversion does): what the readers read back to ``lang``."""
    family = "llama" if model_type == "internlm2" else model_type
    text = {"model_type": family, "hidden_size": lang.hidden_size, "num_hidden_layers": lang.num_layers,
            "num_attention_heads": lang.num_attention_heads, "num_key_value_heads": lang.kv_groups,
            "intermediate_size": lang.ffn_hidden_size, "vocab_size": lang.vocab_real, "hidden_act": "silu",
            "rms_norm_eps": lang.norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": float(lang.rotary_base)},
            "tie_word_embeddings": lang.tie_word_embeddings, "head_dim": lang.kv_channels}
    if family == "llama":
        text.update(attention_bias=False, mlp_bias=False)
    if family in ("qwen3", "qwen3_moe"):
        text.update(attention_bias=False)
    if family == "qwen3_moe":
        text.update(moe_config(lang))
    return text


def moe_config(lang: LanguageSpec) -> dict:
    """The Qwen MoE keys of ``lang.moe`` (what ``qwen_experts`` reads back): every dense layer in
    ``mlp_only_layers``, ``decoder_sparse_step`` 1."""
    moe = lang.moe
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
            "moe_intermediate_size": moe.ffn_hidden_size, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, x in enumerate(moe.layer_freq) if not x],
            "norm_topk_prob": moe.norm_topk_prob}


def embed_name(prefix: str, model_type: str) -> str:
    """The HF name of the token embedding of a ``model_type`` decoder whose tensors start with ``prefix``."""
    return prefix + ("tok_embeddings.weight" if model_type == "internlm2" else "embed_tokens.weight")


def layer_names(prefix: str, model_type: str) -> dict[str, str]:
    """HF names (or name prefixes, ending in ".", where a bias may follow) of one decoder layer of ``model_type``
    whose tensors start with ``prefix`` (``...layers.{i}.``), by role: q/k/v (or fused qkv), o, gate/up/down,
    norm1 (before attention), norm2 (before the MLP), q_norm/k_norm (Qwen3's per-head norms; read only when the
    spec has ``qk_norm``)."""
    p = prefix
    if model_type == "internlm2":
        return {"qkv": p + "attention.wqkv.weight", "o": p + "attention.wo.weight",
                "gate": p + "feed_forward.w1.weight", "up": p + "feed_forward.w3.weight",
                "down": p + "feed_forward.w2.weight", "norm1": p + "attention_norm.weight",
                "norm2": p + "ffn_norm.weight"}
    return {"q": p + "self_attn.q_proj.", "k": p + "self_attn.k_proj.", "v": p + "self_attn.v_proj.",
            "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight",
            "o": p + "self_attn.o_proj.weight", "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight",
            "down": p + "mlp.down_proj.weight", "norm1": p + "input_layernorm.weight",
            "norm2": p + "post_attention_layernorm.weight",
            # MoE layers (Qwen's sparse blocks): the router, the experts' prefix ({e}.gate_proj.weight ...)
            "router": p + "mlp.gate.weight", "experts": p + "mlp.experts."}


def with_tie(lang: LanguageSpec, tie: bool) -> LanguageSpec:
    """``lang`` with ``tie_word_embeddings`` as the layout says."""
    return dataclasses.replace(lang, tie_word_embeddings=bool(tie))
