"""The tokenizer of a run and the vocabulary it gives the model (used by the trainer and the profiler)."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from megatron.vlm.data.template import chat_template_name
from megatron.vlm.data.tokenizer import build_tokenizer, padded_vocab_size

from .arguments import ArgumentError
from .run_plan import RunPlan


def setup_tokenizer(args, plan: RunPlan):
    """(tokenizer, ``plan`` with the tokenizer's source and the model's vocabulary sized from it)."""
    hf = args.hf_checkpoint
    tokenizer_model = plan.tokenizer_model
    if hf and tokenizer_model is None:
        from megatron.vlm.hf.convert import has_tokenizer

        if has_tokenizer(hf):
            tokenizer_model = hf  # the model's own tokenizer (and its special tokens)
    plan = dataclasses.replace(plan, tokenizer_model=tokenizer_model)
    from megatron.vlm.stage.components import runtime_family

    tokenizer = build_tokenizer(tokenizer_model, image_tokens=runtime_family(plan.model_spec).data.image_tokens)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"> conversations are rendered with {chat_template_name(tokenizer)}", flush=True)
    if hf:
        return tokenizer, _check_hf_tokenizer(args, plan, tokenizer)
    # Pad to a multiple of 128 that TP divides, not to 128 x TP as Megatron does: the vocabulary
    # (and so the drawn weights) then stays the same across TP sizes 1, 2, 4, 8, and parallel runs
    # reproduce the serial run.
    vocab = padded_vocab_size(tokenizer.vocab_size, 1)
    if vocab % args.tensor_model_parallel_size:
        vocab = padded_vocab_size(tokenizer.vocab_size, args.tensor_model_parallel_size)
    spec = plan.model_spec
    # the real size too: the padded rows' logits are masked out of the loss (OutputHead)
    spec = spec.replace(language=dataclasses.replace(spec.language, vocab_size=vocab,
                                                     real_vocab_size=tokenizer.vocab_size))
    return tokenizer, dataclasses.replace(plan, model_spec=spec)


def _check_hf_tokenizer(args, plan: RunPlan, tokenizer) -> RunPlan:
    """--hf-checkpoint: the vocabulary is the checkpoint's (config vocab_size, padded); the tokenizer must fit in
    it and its image context token (the family's data side's, ``DataSide.image_tokens``) must be the config's
    image_token_id."""
    from megatron.vlm.hf.configs import read_config, spec_from_config

    spec = plan.model_spec
    _, info = spec_from_config(read_config(args.hf_checkpoint))
    real = spec.language.vocab_real
    if tokenizer.vocab_size > real:
        raise ArgumentError(f"--tokenizer-model {plan.tokenizer_model or '(byte-level)'}: {tokenizer.vocab_size} ids, "
                            f"more than the {real} rows of --hf-checkpoint {args.hf_checkpoint} (text vocab_size)")
    if info.image_token_id is not None and tokenizer.img_context_id != info.image_token_id:
        from megatron.vlm.stage.components import runtime_family

        context = runtime_family(spec).data.image_tokens[2]
        raise ArgumentError(f"--tokenizer-model {plan.tokenizer_model or '(byte-level)'}: {context} is id "
                            f"{tokenizer.img_context_id}, but --hf-checkpoint {args.hf_checkpoint}/config.json has "
                            f"image_token_id {info.image_token_id}")
    vocab = spec.language.vocab_size
    if vocab % args.tensor_model_parallel_size:
        vocab = padded_vocab_size(real, args.tensor_model_parallel_size)
        spec = spec.replace(language=dataclasses.replace(spec.language, vocab_size=vocab))
        plan = dataclasses.replace(plan, model_spec=spec)
    return plan
