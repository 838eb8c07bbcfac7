"""A deterministic stand-in for the generation engine, for the server's and the evaluation's mechanics.

Its answer to a request depends on the last user message only, part by part: a text part gives its text reversed,
an image ``image WxH rgb(R,G,B)`` (size and mean colour, read from the file it was given), a video
``video N frames WxH`` (from the file's header).  Each character is a token (its id: the code point); the
answer stops at ``max_new_tokens`` ("length") or before the first stop string ("stop", the tokens up to and
including the one that completed it kept).  Tokens come one decode step at a time, ``step_s`` apart, for the
whole batch, as a real engine's do; ``batch_sizes`` records each call's batch.  A batch holding the text
``FAIL_TEXT`` raises (a bug in the middle of a batch); counting the prompt of ``COUNT_FAIL_TEXT`` raises too.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import av
import numpy as np
from PIL import Image

from megatron.vlm.inference.requests import GenerationRequest, GenerationResult
from megatron.vlm.inference.server import ServedModel

SEQUENCE_LENGTH = 512
TOKENS_PER_IMAGE, TOKENS_PER_VIDEO = 16, 32
FAIL_TEXT, COUNT_FAIL_TEXT = "fail in the batch", "fail in the count"


def describe_image(path: str) -> str:
    with Image.open(path) as image:
        rgb = np.asarray(image.convert("RGB"), dtype=np.float64)
    r, g, b = (int(round(v)) for v in rgb.reshape(-1, 3).mean(axis=0))
    return f"image {rgb.shape[1]}x{rgb.shape[0]} rgb({r},{g},{b})"


def describe_video(path: str) -> str:
    with av.open(path) as container:
        stream = container.streams.video[0]
        return f"video {stream.frames} frames {stream.codec_context.width}x{stream.codec_context.height}"


def full_answer(messages: Sequence[dict]) -> str:
    """The whole answer to ``messages`` (before max_new_tokens or stop strings cut it)."""
    last = [m for m in messages if m["role"] == "user"][-1]
    content = last["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return " ".join(part["text"][::-1] if part["type"] == "text" else
                    describe_image(part["image"]) if part["type"] == "image" else describe_video(part["video"])
                    for part in parts)


def prompt_tokens(request: GenerationRequest) -> int:
    """Characters of text, plus a fixed count per image and video."""
    if any(p.get("text") == COUNT_FAIL_TEXT for m in request.messages for p in m["content"]):
        raise RuntimeError("a bug while counting")
    count = 0
    for message in request.messages:
        for part in message["content"]:
            count += len(part["text"]) if part["type"] == "text" else \
                TOKENS_PER_IMAGE if part["type"] == "image" else TOKENS_PER_VIDEO
    return count


class StandInGenerator:
    """See the module docstring."""

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Callable[[int, int, str], None] | None = None) -> list[GenerationResult]:
        with self._lock:
            self.batch_sizes.append(len(requests))
        answers = [full_answer(r.messages) for r in requests]
        if any(a == FAIL_TEXT[::-1] for a in answers):
            raise RuntimeError("a bug in the middle of a batch")
        texts = [""] * len(requests)
        finish: list[str | None] = [None] * len(requests)
        step = 0
        while any(f is None for f in finish):
            for i, request in enumerate(requests):
                if finish[i] is not None:
                    continue
                if step >= len(answers[i]):
                    finish[i] = "stop"
                    continue
                char = answers[i][step]
                texts[i] += char
                if on_token is not None:
                    on_token(i, ord(char), char)
                if any(s in texts[i] for s in request.sampling.stop):
                    finish[i] = "stop"
                elif step + 1 >= request.sampling.max_new_tokens:
                    finish[i] = "length" if step + 1 < len(answers[i]) else "stop"
            step += 1
            time.sleep(self.step_s)
        results = []
        for request, text, reason in zip(requests, texts, finish):
            cut = min([text.find(s) for s in request.sampling.stop if s in text], default=len(text))
            results.append(GenerationResult(tuple(map(ord, text)), text[:cut], reason,
                                            prompt_tokens(request)))
        return results


def served(name: str = "stand-in") -> ServedModel:
    return ServedModel(name=name, max_sequence_length=SEQUENCE_LENGTH, count_prompt_tokens=prompt_tokens,
                       default_max_new_tokens=64)
