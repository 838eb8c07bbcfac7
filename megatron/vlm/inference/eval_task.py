"""A local evaluation task for ``omnibal eval``: the trainer's ``messages`` JSONL, each record ending with its
reference answer, and the exact-match score both evaluation back ends report.

A record is read by the trainer's ``messages`` reader (``megatron/vlm/data/messages.py``: string content with
``<image>``/``<video>`` tags and ``images``/``videos`` lists, or structured parts); its last turn must be the
assistant's: that text is the reference, the turns before it are the question.  Media paths are taken relative to
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

from megatron.vlm.data.messages import ImageRef, VideoRef, parse_messages_record
from omnibal_ext.errors import UserError

_OUTER_SPACE = re.compile(r"^\s+|\s+$")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


class EvalTaskError(UserError):
    """A task file this reader refuses; the message starts with ``file:line``."""


@dataclass(frozen=True)
class EvalSample:
    """One question: ``where`` (``file:line``), its turns before the answer as ``(role, segments)`` with text
    strings and media refs (absolute paths), and the reference ``answer``."""

    where: str
    turns: tuple[tuple[str, tuple[str | ImageRef | VideoRef, ...]], ...]
    answer: str


def read_task(path: str, limit: int | None = None) -> list[EvalSample]:
    """The samples of the JSONL task ``path`` (the first ``limit`` where given)."""
    root = os.path.dirname(os.path.abspath(path))
    samples = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except OSError as e:
        raise EvalTaskError(f"--task {path}: cannot read it ({e.strerror or e})") from None
    for number, line in enumerate(lines, 1):
        if limit is not None and len(samples) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalTaskError(f"{where}: not JSON ({e.msg})") from None
        conversation = parse_messages_record(record, where)
        *question, answer = conversation.turns
        turns = tuple((turn.role, tuple(_absolute(s, root) for s in turn.segments)) for turn in question)
        samples.append(EvalSample(where, turns, answer.text))
    if not samples:
        raise EvalTaskError(f"--task {path}: no records")
    return samples


def _absolute(segment, root: str):
    if isinstance(segment, (ImageRef, VideoRef)):
        return type(segment)(segment.index, os.path.normpath(os.path.join(root, segment.path)))
    return segment


def normalize_answer(text: str) -> str:
    """The text as the exact-match score compares it (see the module docstring)."""
    return _OUTER_SPACE.sub("", text).lower().translate(_PUNCTUATION)


def is_correct(prediction: str, reference: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(reference)
