"""The tokenizer of a run and the vocabulary it gives the model (used by the trainer and the profiler)."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from omnibal_ext.model.units import ModelSpec

from megatron.vlm.data.template import chat_template_name
from megatron.vlm.data.tokenizer import build_tokenizer, padded_vocab_size
from megatron.vlm.hf.configs import read_config, spec_from_config
from megatron.vlm.hf.convert import has_tokenizer
from megatron.vlm.stage.components import runtime_family

from .config import RunConfig
from .flags import ArgumentError


def tokenizer_folder(config: RunConfig) -> str | None:
    """The tokenizer's folder: --tokenizer-model, else --hf-checkpoint's folder when it holds a tokenizer (the
    model's own, with its special tokens); None: the built-in byte-level one."""
    hf = config.model.hf_checkpoint
    if config.data.tokenizer_model is None and hf and has_tokenizer(hf):
        return hf
    return config.data.tokenizer_model


def setup_tokenizer(config: RunConfig):
    """(tokenizer, the model ``config.model.spec`` with its vocabulary sized from the tokenizer)."""
    spec = config.model.spec
    folder = tokenizer_folder(config)
    tokenizer = build_tokenizer(folder, image_tokens=runtime_family(spec).data.image_tokens)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"> conversations are rendered with {chat_template_name(tokenizer)}", flush=True)
    tp = config.parallel.tensor_model_parallel_size
    if config.model.hf_checkpoint:
        return tokenizer, _check_hf_tokenizer(spec, config.model.hf_checkpoint, folder, tokenizer, tp)
    # Pad to a multiple of 128 that TP divides, not to 128 x TP as Megatron does: the vocabulary
    # (and so the drawn weights) then stays the same across TP sizes 1, 2, 4, 8, and parallel runs
    # reproduce the serial run.
    vocab = padded_vocab_size(tokenizer.vocab_size, 1)
    if vocab % tp:
        vocab = padded_vocab_size(tokenizer.vocab_size, tp)
    # the real size too: the padded rows' logits are masked out of the loss (OutputHead)
    return tokenizer, spec.replace(language=dataclasses.replace(spec.language, vocab_size=vocab,
                                                                real_vocab_size=tokenizer.vocab_size))


def _check_hf_tokenizer(spec: ModelSpec, hf: str, folder: str | None, tokenizer, tp: int) -> ModelSpec:
    """--hf-checkpoint ``hf``: the vocabulary is the checkpoint's (config vocab_size, padded for ``tp``); the
    tokenizer (of ``folder``) must fit in it and its image context token (the family's data side's,
    ``DataSide.image_tokens``) must be the config's image_token_id."""
    _, info = spec_from_config(read_config(hf))
    real = spec.language.vocab_real
    if tokenizer.vocab_size > real:
        raise ArgumentError(f"--tokenizer-model {folder or '(byte-level)'}: {tokenizer.vocab_size} ids, "
                            f"more than the {real} rows of --hf-checkpoint {hf} (text vocab_size)")
    if info.image_token_id is not None and tokenizer.img_context_id != info.image_token_id:
        context = runtime_family(spec).data.image_tokens[2]
        raise ArgumentError(f"--tokenizer-model {folder or '(byte-level)'}: {context} is id "
                            f"{tokenizer.img_context_id}, but --hf-checkpoint {hf}/config.json has "
                            f"image_token_id {info.image_token_id}")
    vocab = spec.language.vocab_size
    if vocab % tp:
        spec = spec.replace(language=dataclasses.replace(spec.language, vocab_size=padded_vocab_size(real, tp)))
    return spec
