"""A request's answer as its tokens come: when it stops, its text, and the text deltas a stream sends (torch-free).

Stops: a stop token (the default end tokens unless ``ignore_eos``, and the request's ``stop_token_ids``; the token is
kept in ``token_ids`` as transformers' ``generate`` keeps it, and left out of the text), a stop string (the text is
cut before it; the tokens up to the one that completed it are kept), or ``max_new_tokens`` ("length").

Streaming: each token's delta is the text that has become final. Text that may still turn into a stop string (a
suffix of the text that is a prefix of one) and an incomplete UTF-8 character (the tokenizer's "\\ufffd") are held
back until the next tokens decide them; the concatenated deltas are the final text.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .requests import GenerationResult, SamplingParams

REPLACEMENT = "\ufffd"


def default_stop_ids(tokenizer, generation_config_eos: Iterable[int] = ()) -> frozenset[int]:
    """The end tokens every answer stops at unless ``ignore_eos``: the tokenizer's end of sequence and end of turn
    (the chat template's ``<|im_end|>``: the trainer's answers end with it) and the folder's
    ``generation_config.json`` ``eos_token_id`` (what transformers' ``generate`` stops at)."""
    ids = {int(i) for i in generation_config_eos}
    for name in ("eos_id", "im_end_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            ids.add(int(value))
    return frozenset(ids)


@dataclass
class TextStream:
    """One request's tokens and text (module docstring). ``decode(ids) -> str`` is the tokenizer's."""

    params: SamplingParams
    decode: Callable[[list[int]], str]
    end_ids: frozenset[int]  # default_stop_ids
    prompt_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already streamed
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def stop_ids(self) -> frozenset[int]:
        own = frozenset(self.params.stop_token_ids)
        return own if self.params.ignore_eos else own | self.end_ids

    def add(self, token: int) -> str:
        """Take the next token; returns the text delta that became final."""
        if self.finished:
            raise ValueError("TextStream: a token after the answer finished")
        self.tokens.append(int(token))
        if int(token) in self.stop_ids():
            self.finish_reason = "stop"
        else:
            self.text = self.decode(self.tokens)
            cut = self._stop_string_at()
            if cut is not None:
                self.text, self.finish_reason = self.text[:cut], "stop"
        if not self.finished and len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self._delta()

    def _stop_string_at(self) -> int | None:
        found = [i for i in (self.text.find(s) for s in self.params.stop) if i >= 0]
        return min(found) if found else None

    def _delta(self) -> str:
        end = len(self.text)
        if not self.finished:
            end = min(end, self._held_back())
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _held_back(self) -> int:
        """Where the text that cannot be sent yet starts."""
        text, end = self.text, len(self.text)
        while end > 0 and text[end - 1] == REPLACEMENT:
            end -= 1
        for s in self.params.stop:  # a suffix that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    end = min(end, len(text) - k)
                    break
        return end

    def result(self) -> GenerationResult:
        if not self.finished:
            raise ValueError("TextStream: the answer has not finished")
        return GenerationResult(tuple(self.tokens), self.text, self.finish_reason, self.prompt_tokens)
