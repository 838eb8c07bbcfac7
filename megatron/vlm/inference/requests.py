"""The generation interface shared by ``omnibal generate``, ``omnibal serve`` and evaluation.

A ``GenerationRequest`` is the trainer's ``messages`` record without its final assistant turn (the chat template
adds the generation prompt); its media parts name local files.  A ``Generator`` answers a batch of them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token;
    ``seed`` seeds the request's sampler (None: unseeded); generation ends after ``max_new_tokens`` tokens, at
    a stop token (the model's end of turn, or one of ``stop_token_ids``) or when the text holds one of ``stop``
    (the text is cut before it)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """``messages``: the trainer's ``messages`` record without the final assistant turn (media parts name local
    files); ``sampling``: how to decode it."""

    messages: tuple[dict, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class GenerationResult:
    """The new tokens only: ``token_ids`` and their ``text``; ``finish_reason`` "stop" or "length";
    ``prompt_tokens``: the length of the rendered prompt."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int


class Generator(Protocol):
    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Callable[[int, int, str], None] | None = None) -> list[GenerationResult]:
        """The results of ``requests``, in order.  Collective: every rank of the layout calls it with the same
        requests; ``on_token(request index, token id, its text)`` is called on rank 0 as tokens come."""
        ...
