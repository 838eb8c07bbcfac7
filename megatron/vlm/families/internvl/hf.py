"""InternVL's Hugging Face tensor names (native ``InternVLForConditionalGeneration`` and original OpenGVLab
``InternVLChatModel`` layouts) and the mapping of its own units (ViT embedding, ViT layers, projector) to
our global tensors; the GPT decoder's units map through ``megatron.vlm.hf.recipes``.  The config reader is
``megatron.vlm.hf.config``.
"""
from __future__ import annotations

from megatron.vlm.hf.config import HFInfo
from megatron.vlm.hf.recipes import Part, Recipe, whole


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
        return self.llm + ("tok_embeddings.weight" if self.info.text_family == "internlm2" else "embed_tokens.weight")

    def llm_layer(self, i: int) -> dict[str, str]:
        p = f"{self.llm}layers.{i}."
        if self.info.text_family == "internlm2":
            return {"qkv": p + "attention.wqkv.weight", "o": p + "attention.wo.weight",
                    "gate": p + "feed_forward.w1.weight", "up": p + "feed_forward.w3.weight",
                    "down": p + "feed_forward.w2.weight", "norm1": p + "attention_norm.weight",
                    "norm2": p + "ffn_norm.weight"}
        return {"q": p + "self_attn.q_proj.", "k": p + "self_attn.k_proj.", "v": p + "self_attn.v_proj.",
                "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight",
                "o": p + "self_attn.o_proj.weight", "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight",
                "down": p + "mlp.down_proj.weight", "norm1": p + "input_layernorm.weight",
                "norm2": p + "post_attention_layernorm.weight"}

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


def logits_batch(inputs: dict, spec, info) -> dict:
    """The micro-batch of one sample from transformers' inputs (``input_ids [1, s]`` already holding
    ``image_seq_length`` image-token ids per tile, ``pixel_values [tiles, 3, H, W]``), as the collate makes it."""
    import torch

    from megatron.vlm.data.collate import collate_padded

    ids = inputs["input_ids"].reshape(-1).to(torch.int64)
    pixels = inputs["pixel_values"].to(torch.float32)
    sample = {"input_ids": ids.numpy(), "labels": torch.zeros_like(ids).numpy(), "pixel_values": pixels,
              "image_flags": torch.ones(len(pixels), dtype=torch.int64)}
    return collate_padded([sample], pad_id=0)


def structure_twin(spec):
    """A tiny model with ``spec``'s structure (unit list, per-layer features, heads)."""
    import dataclasses

    v, lang = spec.vision, spec.language
    f = int(round(1 / spec.downsample_ratio))
    vision = dataclasses.replace(v, hidden_size=2 * v.num_attention_heads, ffn_hidden_size=4, image_size=f, patch_size=1)
    language = dataclasses.replace(lang, hidden_size=8, head_dim=2, ffn_hidden_size=4, vocab_size=128, real_vocab_size=None)
    return spec.replace(vision=vision, language=language)
