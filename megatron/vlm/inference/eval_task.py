"""A local evaluation task for ``omnibal eval``: a JSONL of the trainer's records (``messages``, or the
``conversations`` format), and the exact-match score both evaluation back ends report.

A record is read by the trainer's own record reader (``megatron.vlm.data.records.record_turns``: either format,
``<image>``/``<video>`` tags or structured parts).  Each assistant turn is an answer to ask: its question is every
turn before it, earlier answers as the record writes them (teacher-forced history, as the trainer's validation has
it), and its text is the reference.  A record is right when all its answers are.  Media paths are taken relative to
the task file's folder.

An answer is right when it equals the reference after both are normalised: whitespace at either end removed, lower
case, ASCII punctuation removed (lmms-eval's ``exact_match`` with ``ignore_case``, ``ignore_punctuation`` and
``regexes_to_ignore`` for the outer whitespace, in that order).
"""
from __future__ import annotations

import json
import os
import re
import string
from dataclasses import dataclass

from megatron.vlm.data.messages import IMAGE_TAG, VIDEO_TAG, ImageRef, VideoRef
from megatron.vlm.data.records import record_turns
from omnibal_ext.errors import UserError

_TAGS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")
_OUTER_SPACE = re.compile(r"^\s+|\s+$")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


class EvalTaskError(UserError):
    """A task file this reader refuses; the message starts with ``file:line``."""


@dataclass(frozen=True)
class EvalSample:
    """One answer to ask: ``where`` (``file:line``, and which answer of a record with several), ``record`` (its
    record's number in the task), the turns before it as ``(role, segments)`` (text strings and media refs with
    absolute paths) and the reference ``answer``."""

    where: str
    record: int
    turns: tuple[tuple[str, tuple[str | ImageRef | VideoRef, ...]], ...]
    answer: str


def read_task(path: str, limit: int | None = None) -> list[EvalSample]:
    """The answers of the JSONL task ``path`` (those of its first ``limit`` records where given)."""
    root = os.path.dirname(os.path.abspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except OSError as e:
        raise EvalTaskError(f"--task {path}: cannot read it ({e.strerror or e})") from None
    samples, records = [], 0
    for number, line in enumerate(lines, 1):
        if limit is not None and records >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            turns, images, videos = record_turns(json.loads(line))
        except json.JSONDecodeError as e:
            raise EvalTaskError(f"{where}: not JSON ({e.msg})") from None
        except UserError as e:
            raise EvalTaskError(f"{where}: {e}") from None
        media = {ImageRef: [os.path.join(root, p) for p in images],
                 VideoRef: [os.path.join(root, v.path) for v in videos]}
        if any(v.clip_s is not None for v in videos):
            raise EvalTaskError(f"{where}: a video 'clip'; the chat API sends whole videos")
        history: list[tuple[str, tuple]] = []
        answers = sum(t.role == "assistant" for t in turns)
        for turn in turns:
            if turn.role == "assistant":
                name = where if answers == 1 else f"{where} (answer {sum(r == 'assistant' for r, _ in history) + 1})"
                samples.append(EvalSample(name, records, tuple(history), turn.text))
            history.append((turn.role, _segments(turn.text, media)))
        records += 1
    if not samples:
        raise EvalTaskError(f"--task {path}: no records")
    return samples


def _segments(text: str, media: dict) -> tuple:
    """``text`` split at its tags, each tag the next path of its kind (``media``: consumed in reading order)."""
    out = []
    for piece in _TAGS.split(text):
        if piece in (IMAGE_TAG, VIDEO_TAG):
            kind = ImageRef if piece == IMAGE_TAG else VideoRef
            out.append(kind(-1, os.path.normpath(media[kind].pop(0))))
        elif piece:
            out.append(piece)
    return tuple(out)


def normalize_answer(text: str) -> str:
    """The text as the exact-match score compares it (see the module docstring)."""
    return _OUTER_SPACE.sub("", text).lower().translate(_PUNCTUATION)


def is_correct(prediction: str, reference: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(reference)
