"""The GPT decoder's output head, shared by every family: final norm, vocabulary-parallel output layer and
either the per-token loss with the argmax check (training) or this TP rank's logits (the HF logits check),
chosen when the head is built.

Vocabulary padding: the padded rows' logits become ``PADDED_LOGIT`` before ``vocab_parallel_cross_entropy``
and the argmax, so the loss equals that of the unpadded model.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from omnibal_ext.model.spec import ModelSpec

OUTPUTS = ("loss", "logits")


class HeadOutput(NamedTuple):
    """What the last stage returns in loss mode: per-token loss [b, s] (fp32) and whether the label holds the
    maximal logit [b, s] (bool, no gradient)."""

    loss: torch.Tensor
    correct: torch.Tensor


class OutputHead(MegatronModule):
    """Final norm, vocabulary-parallel output layer and cross entropy.

    output "loss": [b * s, 1, H], labels [b, s] -> HeadOutput(loss [b, s], correct [b, s]);
    output "logits": [t, 1, H] -> this TP rank's logits [t, 1, V/tp].
    """

    def __init__(self, spec: ModelSpec, config: TransformerConfig, norm_module, output: str = "loss"):
        super().__init__(config=config)
        if output not in OUTPUTS:
            raise ValueError(f"head output must be one of {OUTPUTS}, got {output!r}")
        self.norm = norm_module(config=config, hidden_size=spec.language.hidden_size, eps=config.layernorm_epsilon)
        self.output = tensor_parallel.ColumnParallelLinear(
            spec.language.hidden_size, spec.language.vocab_size, config=config,
            init_method=config.init_method, bias=False, gather_output=False)
        self.vocab_size, self.real_vocab = spec.language.vocab_size, spec.language.vocab_real
        self.output_kind = output

    def logits(self, hidden):
        """This TP rank's logits [t, 1, V/tp] of ``hidden`` [t, 1, H], whatever the output mode (generation)."""
        logits, _ = self.output(self.norm(hidden))
        return logits

    def forward(self, hidden, labels=None):
        logits = self.logits(hidden)  # [t, 1, V/tp]
        if self.output_kind == "logits":
            return logits
        targets = labels.clamp(min=0).reshape(-1, 1)
        if self.real_vocab < self.vocab_size:  # padded rows take no part in the softmax nor the argmax
            logits = mask_padded_vocab(logits.float(), self.real_vocab)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)
        correct = vocab_parallel_argmax_matches(logits.detach(), targets).reshape(labels.shape)
        return HeadOutput(loss.reshape(labels.shape), correct)


# what padded vocabulary rows' logits become: exp() of it minus any real logit is exactly 0 in fp32
PADDED_LOGIT = -1e30


def mask_padded_vocab(logits: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """This TP rank's logits [..., V/tp] with the columns of padded vocabulary rows (global id >=
    ``real_vocab``) set to ``PADDED_LOGIT``."""
    part = logits.shape[-1]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * part if tp > 1 else 0
    if start + part <= real_vocab:
        return logits
    padded = torch.arange(start, start + part, device=logits.device) >= real_vocab
    return logits.masked_fill(padded, PADDED_LOGIT)


def vocab_parallel_argmax_matches(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Whether the target holds the maximal logit over the whole (tensor-parallel split) vocabulary."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    local_max = logits.max(dim=-1).values
    inside = (targets >= start) & (targets < start + part)
    idx = (targets - start).clamp(0, part - 1)
    target_logit = torch.where(inside, logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(local_max))
    if tp > 1:
        torch.distributed.all_reduce(local_max, op=torch.distributed.ReduceOp.MAX, group=group)
        torch.distributed.all_reduce(target_logit, group=group)
    return target_logit >= local_max
