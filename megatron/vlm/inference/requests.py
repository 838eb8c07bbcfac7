"""What generation takes and gives (torch-free): the interface between the engine (``megatron.vlm.inference``) and
its callers (``omnibal generate``, ``omnibal serve``, ``--eval-generate``).

A request is a conversation as the trainer reads it (a ``messages`` record, ``megatron/vlm/data/messages.py``)
without its final assistant turn: the chat template adds the generation prompt. Media parts name local files
(absolute paths, or ``images`` / ``videos`` with ``<image>`` / ``<video>`` tags in the text, as in a record).

A ``Generator`` is collective: every rank of the layout calls ``generate`` with the same requests (a server's
rank 0 hands them to the other ranks first); the results are the same on every rank, ``on_token`` is called on
global rank 0 only.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

FINISH_REASONS = ("stop", "length")


class SamplingError(ValueError):
    """A sampling setting out of its range (``SamplingParams.check``); the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen.

    max_new_tokens: at most this many new tokens (>= 1); temperature: 0 greedy (the argmax), else the logits are
    divided by it before top-k / top-p and the softmax; top_p in (0, 1]: the smallest set of most likely tokens whose
    probability reaches it (1: all); top_k: the k most likely tokens (0: all); seed: the request's own generator
    (None: seeded from the request's index in the call, so a call is reproducible); stop: strings that end the
    answer when its text contains one (the text is cut before it); stop_token_ids: tokens that end it, besides the
    tokenizer's end-of-sequence and end-of-turn tokens and those of the folder's ``generation_config.json``;
    ignore_eos: do not stop at those default tokens (``stop_token_ids`` still stop; benchmarks and tests).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's / generation_config's eos
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> None:
        """Raise ``SamplingError`` naming the first field out of its range."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens {self.max_new_tokens!r}: must be an integer >= 1")
        if not self.temperature >= 0.0:
            raise SamplingError(f"temperature {self.temperature!r}: must be >= 0 (0: greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p {self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k {self.top_k!r}: must be an integer >= 0 (0: off)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError(f"stop {self.stop!r}: must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingError(f"stop_token_ids {self.stop_token_ids!r}: must be token ids (integers >= 0)")


@dataclass(frozen=True)
class GenerationRequest:
    """One conversation to answer.

    messages: a ``messages`` record's turns as the trainer reads them, without the final assistant turn (string
    content with ``<image>`` / ``<video>`` tags, or structured parts ``{"type": "image", "image": PATH}``);
    images / videos: the files of the tags, in order (absolute paths); sampling: how its tokens are chosen."""

    messages: tuple[dict, ...]
    sampling: SamplingParams = SamplingParams()
    images: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()

    def record(self) -> dict:
        """The request as a ``messages`` record (without its answer: ``omnibal generate``'s input line)."""
        record: dict = {"messages": list(self.messages)}
        if self.images:
            record["images"] = list(self.images)
        if self.videos:
            record["videos"] = list(self.videos)
        return record


@dataclass(frozen=True)
class GenerationResult:
    """One request's answer: ``token_ids`` the new tokens only (a stop token included, as transformers' ``generate``
    returns it), ``text`` their text without the stop token or stop string (nor what follows it), ``finish_reason``
    "stop" (a stop token or string) or "length" (``max_new_tokens``), ``prompt_tokens`` the prompt's length."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int


TokenCallback = Callable[[int, int, str], None]  # (request index, token id, text delta)


class Generator(Protocol):
    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[GenerationResult]:
        """Collective: every rank of the layout calls it with the same requests. ``on_token(request index, token id,
        text delta)`` is called on rank 0 as each token is decided (streaming)."""
        ...
