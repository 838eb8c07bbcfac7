"""Tiny random transformers Qwen3.5-MoE models for the HF tests (no download): ``hf_tiny_qwen3_5``'s model (5 LLM
layers linear, full, full, linear, linear; partial rotary; linear heads unlike the attention heads; 3 ViT heads)
with every layer's MLP the sparse MoE block: top 2 of 6 experts of width 20 beside hidden 32 (H != 2I), a shared
expert of width 12 behind its sigmoid gate; every parameter perturbed, the zero-centred norms near 1 + 0."""
from __future__ import annotations

import torch
import hf_tiny_qwen3_5 as dense
from hf_tiny_qwen3_5 import EPS, LAYER_TYPES, eager, hf_logits, inputs

EXPERTS, TOPK, EXPERT_FFN, SHARED_FFN = 6, 2, 20, 12

__all__ = ["hf_moe_config", "make_tiny_moe", "make_tiny_moe_with_tokenizer", "training_flags", "inputs", "hf_logits"]


def hf_moe_config(tie=False, layer_types=LAYER_TYPES, eps=EPS):
    """``hf_tiny_qwen3_5.hf_config``'s sizes as a Qwen3_5MoeConfig."""
    from transformers import Qwen3_5MoeConfig

    base = dense.hf_config(tie=tie, layer_types=layer_types, eps=eps).to_dict()
    text = {k: v for k, v in base["text_config"].items() if k not in ("intermediate_size", "model_type")}
    text.update(num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=EXPERT_FFN,
                shared_expert_intermediate_size=SHARED_FFN)
    vision = {k: v for k, v in base["vision_config"].items() if k != "model_type"}
    top = {k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                                 "tie_word_embeddings")}
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, **top)


def make_tiny_moe(folder, seed=0, published=False, **kw):
    """Save a tiny perturbed Qwen3_5MoeForConditionalGeneration to ``folder``; returns it (eval, fp32, eager).
    The experts as a 5.23 save_pretrained writes them (one tensor per expert and matrix), or with ``published`` as
    the published Qwen3.5-MoE files hold them: stacked, ``mlp.experts.gate_up_proj [E, 2I, H]`` (each expert's gate
    rows, then its up rows) and ``down_proj [E, H, I]``."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(hf_moe_config(**kw)).eval()
    dense.perturb_zero_centred(model, seed)
    if kw.get("tie"):
        model.tie_weights()
    model.save_pretrained(str(folder))
    if published:
        path = f"{folder}/model.safetensors"
        tensors = load_file(path)
        for i in range(model.config.text_config.num_hidden_layers):
            p = f"model.language_model.layers.{i}.mlp.experts."
            per = [{m: tensors.pop(f"{p}{e}.{m}_proj.weight") for m in ("gate", "up", "down")} for e in range(EXPERTS)]
            tensors[p + "gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in per])
            tensors[p + "down_proj"] = torch.stack([x["down"] for x in per])
        save_file(tensors, path, metadata={"format": "pt"})
    return eager(model)


def make_tiny_moe_with_tokenizer(folder, seed=0, **kw):
    """``hf_tiny_qwen3_5.make_tiny_with_tokenizer`` with the MoE model."""
    return dense.make_tiny_with_tokenizer(folder, seed, make_tiny_moe, **kw)


def training_flags(folder, data_cache, seed=3, **kw) -> list[str]:
    """``hf_tiny_qwen3_5.training_flags`` with the MoE model."""
    return dense.training_flags(folder, data_cache, seed, make_tiny_moe, **kw)
