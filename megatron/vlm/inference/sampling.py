"""Choosing each sequence's next token from its logits (the last stage's gathered fp32 logits over the real
vocabulary, so every TP size sees the same numbers).

Greedy (temperature 0): the argmax. Sampling, in transformers' order: logits / temperature, then the top-k, then the
nucleus (the smallest set of most likely tokens whose probability reaches top_p; the most likely one always kept),
then one draw from the softmax with the request's own ``torch.Generator`` (CPU, seeded by the request: the draws do
not depend on the layout or on the other requests of the batch).
"""
from __future__ import annotations

import torch

from .requests import SamplingParams


def request_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """The generator of request ``index`` (its ``seed``, else the index): None for greedy requests."""
    if params.greedy:
        return None
    return torch.Generator().manual_seed(params.seed if params.seed is not None else index)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits`` [V] fp32 / temperature with the tokens outside the top-k and the nucleus at -inf."""
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(x, descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the tokens more likely than each
        drop = before >= params.top_p
        drop[0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token of one sequence from its logits [V] (fp32, real vocabulary)."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_logits(logits, params).softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
