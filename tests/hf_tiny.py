"""Tiny random transformers InternVL models for the HF conversion tests (no download): every parameter
perturbed (HF init leaves norms, biases and layer scales constant, which would hide swapped keys); a small
character tokenizer for fine-tunes; our model's logits of an HF folder (in this process, a world of one)."""
from __future__ import annotations

import contextlib

import torch

IMAGE, PATCH = 28, 7  # 4x4 patches per tile -> 4 image tokens per tile after pixel shuffle
TOKENS_PER_TILE = 4

VIT_CASES = {
    "ln-bias": dict(norm_type="layer_norm", attention_bias=True, use_qk_norm=False),
    "rms-qknorm": dict(norm_type="rms_norm", attention_bias=False, use_qk_norm=True),
}


def perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.2 * noise if (p.dim() > 1 or name.endswith("bias")) else 1.0 + 0.3 * noise)


MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20, mlp_only_layers=[1])  # H 32 != 2I 40


def hf_config(vit="ln-bias", text="qwen2", vit_heads=2, vocab=300, vit_layers=2, llm_layers=2, tie=None, head_dim=12,
              moe=None):
    from transformers import InternVLConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    vc = InternVLVisionConfig(hidden_size=8 * vit_heads, num_attention_heads=vit_heads, intermediate_size=32,
                              num_hidden_layers=vit_layers, image_size=IMAGE, patch_size=PATCH, layer_norm_eps=1e-6,
                              layer_scale_init_value=0.1, **VIT_CASES[vit])
    common = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                  num_hidden_layers=llm_layers, vocab_size=vocab, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    if text == "qwen2":
        tc = Qwen2Config(**common)
        tie = False if tie is None else tie
    elif text == "qwen3":  # InternVL3.5: per-head q/k norm, head_dim not hidden / heads (12, not 8)
        tc = Qwen3Config(**common, head_dim=head_dim or 8, attention_bias=False)
        tie = False if tie is None else tie
    elif text == "qwen3_moe":  # InternVL3.5-MoE: Qwen3 attention, experts (``moe``: Qwen3MoeConfig keys, MOE's)
        tc = Qwen3MoeConfig(**common, head_dim=head_dim or 8, attention_bias=False, **{**MOE, **(moe or {})})
        tie = False if tie is None else tie
    else:
        tc = LlamaConfig(**common, head_dim=head_dim or 8, attention_bias=False, mlp_bias=False)
        tie = True if tie is None else tie
    tc.tie_word_embeddings = tie
    return InternVLConfig(vision_config=vc, text_config=tc, image_token_id=vocab - 1,
                          image_seq_length=TOKENS_PER_TILE, tie_word_embeddings=tie)


def make_tiny(folder, seed=0, **kw):
    """Save a tiny perturbed InternVLForConditionalGeneration to ``folder``; returns it (eval, fp32)."""
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(hf_config(**kw)).eval()
    perturb(model, seed)
    model.save_pretrained(str(folder))
    return model


def inputs(vocab=300, tiles=2, text=7, seed=1):
    """input_ids [1, s] with TOKENS_PER_TILE image ids per tile (after a few text ids), pixel_values."""
    g = torch.Generator().manual_seed(seed)
    image_id = vocab - 1
    head = torch.randint(0, vocab - 1, (3,), generator=g)
    tail = torch.randint(0, vocab - 1, (text,), generator=g)
    ids = torch.cat([head, torch.full((tiles * TOKENS_PER_TILE,), image_id), tail]).unsqueeze(0)
    pixels = torch.randn(tiles, 3, IMAGE, IMAGE, generator=g)
    return {"input_ids": ids, "pixel_values": pixels}


def hf_logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits[0].float()


SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"]
VOCAB = 110  # 7 special + 96 characters = 103 ids; the model has a few rows more


def write_tokenizer(folder):
    """A character-level WordLevel tokenizer with InternVL's special tokens and a ChatML chat template; returns the
    id of its <IMG_CONTEXT>."""
    from hf_check import write_char_tokenizer

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return write_char_tokenizer(folder, SPECIALS, template, pad_token="<pad>", eos_token="<|im_end|>")["<IMG_CONTEXT>"]


def make_tiny_with_tokenizer(folder, seed=0, **kw):
    """A new folder ``folder`` with ``write_tokenizer``'s tokenizer and a tiny perturbed model (``make_tiny``, a
    ``VOCAB``-row vocabulary) whose image token is that tokenizer's; returns (the model, the image token id)."""
    folder.mkdir()
    image_id = write_tokenizer(folder)
    model = make_tiny(folder, seed=seed, vocab=VOCAB, **kw)
    model.config.image_token_id = image_id
    model.save_pretrained(str(folder))
    return model, image_id


def inputs_with_image_id(image_id: int, tiles=2):
    """``inputs`` over a ``VOCAB``-row vocabulary with ``image_id`` as the image token (random text ids that
    happen to be ``image_id`` moved to the next id)."""
    batch = inputs(vocab=VOCAB, tiles=tiles)
    ids = batch["input_ids"]
    text = ids != VOCAB - 1
    ids[text & (ids == image_id)] = image_id + 1
    ids[~text] = image_id
    return batch


@contextlib.contextmanager
def world_of_one():
    """A world of one (gloo) with megatron's groups inside the CPU patches, torn down after."""
    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, initialize_distributed

    with cpu_compat.patched():
        try:
            initialize_distributed(torch.device("cpu"), 1, 1)
            yield
        finally:
            destroy()


def our_logits(folder, batch) -> torch.Tensor:
    """Our model's logits [s, real vocab] of the HF folder ``folder`` on ``batch`` (TP1, in this process)."""
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    with world_of_one():
        return chained_logits(HFSource.open(str(folder)), batch)
