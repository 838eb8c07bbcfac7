"""Prompts: requests (``messages`` records without their answer) read by the trainer's own reader, cut before the
answer.

The trainer's reader (``megatron.vlm.data.records.RecordDataset``: the family's image and video rules, the chat
template, the validation scan) reads conversations that end with an answer. A request gets an empty assistant turn
and is read as a training sample; its prompt is the sample's tokens before the first answer token (the labels say
where): the chat template's text up to and including its generation prompt, the images' and videos' tokens and
pixels as training has them. A training sample's own answers become prompts the same way (``answer_prompts``:
``--eval-generate``), each with the history before it as the trainer rendered it.

The requests go through one validation scan (``scan_annotations``, ``skip_bad``): every problem of every record
(malformed JSON, a missing or undecodable image or video, a chat template that refuses it) is found before any
model work and named ``file:line`` (``omnibal generate --input``) or ``request k`` (the ``Generator`` API).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnibal_ext.errors import UserError

from megatron.vlm.data.records import ReaderConfig, RecordDataset
from megatron.vlm.data.template import IGNORE_INDEX

TOKEN_FIELDS = ("input_ids", "labels", "mm_token_type_ids")  # a sample's per-token fields (RecordDataset.sample)


class PromptError(UserError):
    """Requests the reader refuses; each line names ``file:line`` or ``request k``."""


@dataclass(frozen=True)
class Prompt:
    """One prompt as the trainer's reader makes a sample (``RecordDataset.sample``'s dict: ``input_ids``, pixels,
    image sizes, video blocks, ...), cut before its answer; ``answer``: the tokens the sample answered with there
    (``answer_prompts``; empty for a request)."""

    sample: dict
    answer: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        return len(self.sample["input_ids"])


def cut_sample(sample: dict, end: int) -> dict:
    """``sample`` with its per-token fields cut to the first ``end`` tokens and no labels (every image and video of a
    prompt comes before its answer, so its media fields stay)."""
    out = dict(sample)
    for key in TOKEN_FIELDS:
        if key in out and out[key] is not None:
            out[key] = out[key][:end]
    out["labels"] = torch.full((end,), IGNORE_INDEX, dtype=torch.int64)
    return out


def answer_starts(labels: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` token positions of each answer of a sample from its shifted labels (label ``j`` is token
    ``j + 1`` when that token is an answer's, else -100)."""
    marked = torch.cat([torch.zeros(1, dtype=torch.bool), torch.as_tensor(labels)[:-1] != IGNORE_INDEX])
    spans, start = [], None
    for j, on in enumerate(marked.tolist()):
        if on and start is None:
            start = j
        elif not on and start is not None:
            spans.append((start, j))
            start = None
    if start is not None:
        spans.append((start, len(marked)))
    return spans


def answer_prompts(sample: dict) -> list[Prompt]:
    """One prompt per answer of a training sample: its tokens before the answer, the answer's tokens (its text and
    the end-of-turn token the labels hold)."""
    ids = torch.as_tensor(sample["input_ids"])
    return [Prompt(cut_sample(sample, start), tuple(int(t) for t in ids[start:end]))
            for start, end in answer_starts(sample["labels"])]


def request_line(record) -> tuple[str, str | None]:
    """(the JSONL line the reader gets for one request record, its problem or None): a ``messages`` record whose last
    turn is not an answer gets an empty assistant turn; anything else goes as it is (the scan names its problem)."""
    if not isinstance(record, dict) or "messages" not in record:
        if isinstance(record, dict) and "conversations" in record:
            return json.dumps(record), "a 'conversations' record: generation reads 'messages' records"
        return json.dumps(record), None
    messages = record["messages"]
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
            and messages[-1].get("role") == "assistant":
        return json.dumps(record), ("the conversation ends with an assistant turn: give it without its answer (the "
                                    "chat template adds the generation prompt)")
    if not isinstance(messages, list):
        return json.dumps(record), None
    return json.dumps({**record, "messages": [*messages, {"role": "assistant", "content": ""}]}), None


def read_prompts(lines: Sequence[str], root: str, tokenizer, config: ReaderConfig, names: Sequence[str]) -> list[Prompt]:
    """The prompts of JSONL ``lines`` (one record per non-blank line; media paths relative to ``root``) read by the
    trainer's reader with ``config``; ``names[i]`` names line ``i`` in errors (``file:line``, ``request k``). Raises
    ``PromptError`` listing every problem found, before any model work."""
    out_lines, problems = [], []
    for i, raw in enumerate(lines):
        if not raw.strip():
            out_lines.append("")
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            problems.append(f"{names[i]}: not valid JSON ({e.msg})")
            out_lines.append("")
            continue
        line, problem = request_line(record)
        if problem:
            problems.append(f"{names[i]}: {problem}")
        out_lines.append(line)
    if problems:
        raise PromptError(_listed(problems))
    if not any(out_lines):
        raise PromptError(f"{names[0] if names else 'input'}: no request")
    with tempfile.TemporaryDirectory(prefix="omnibal-generate-") as tmp:
        annotation = os.path.join(tmp, "requests.jsonl")
        with open(annotation, "w") as f:
            f.write("".join(line + "\n" for line in out_lines))
        meta = os.path.join(tmp, "meta.json")
        with open(meta, "w") as f:
            json.dump({"requests": {"root": os.path.abspath(root), "annotation": annotation}}, f)
        config = ReaderConfig(images=config.images, videos=config.videos, system=config.system,
                              add_bos=config.add_bos, skip_bad=True)
        try:
            dataset = RecordDataset(meta, tokenizer, config.images, system=config.system, add_bos=config.add_bos,
                                    skip_bad=True, videos=config.videos, progress=False)
        except UserError:  # every request has a problem: the scan without skipping lists them all
            try:
                RecordDataset(meta, tokenizer, config.images, system=config.system, add_bos=config.add_bos,
                              videos=config.videos, progress=False)
            except UserError as e:
                listed = [line.strip() for line in str(e).splitlines()[1:] if line.strip()] or [str(e)]
                raise PromptError(_listed([_renamed(p, annotation, names) for p in listed])) from None
            raise
        if dataset.scan.skipped:
            raise PromptError(_listed([_renamed(p, annotation, names) for p in dataset.scan.skipped]))
        prompts = []
        for i in range(len(dataset)):
            sample = dataset.sample(i)
            spans = answer_starts(sample["labels"])
            if not spans:  # cannot happen: the empty answer's end-of-turn token is labelled
                raise PromptError(f"{_renamed(dataset.where(i), annotation, names)}: the chat template gives the "
                                  "answer no token, so the prompt's end is unknown")
            prompts.append(Prompt(cut_sample(sample, spans[0][0])))
    return prompts


def _renamed(problem: str, annotation: str, names: Sequence[str]) -> str:
    """A scan problem ``annotation:line: ...`` named as its request (``names[line - 1]``)."""
    if problem.startswith(annotation + ":"):
        rest = problem[len(annotation) + 1:]
        line, _, message = rest.partition(":")
        if line.isdigit():
            return f"{names[int(line) - 1]}:{message}"
    return problem


def _listed(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problem(s) in the requests:\n  " + "\n  ".join(problems)
