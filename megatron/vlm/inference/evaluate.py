"""``omnibal eval``: a local task (``eval_task.py``) answered by a running ``omnibal serve`` over its
OpenAI-compatible API, scored by exact match.

Two back ends ask the same server the same questions (greedy, ``max_new_tokens`` each):

* ``omnibal`` (``evaluate_with_client``): this process sends each sample with the ``openai`` client, ``concurrency``
  at a time (the server batches them), media as data URLs (``media="data-url"``, what lmms-eval sends) or as the
  files' paths (``media="path"``, for a server on the same machine);
* ``lmms-eval`` (``lmms_eval_task.py``): lmms-eval, run from its own Python environment, with the task written as
  an lmms-eval YAML over a local JSONL.

Both give an ``EvalReport``.
"""
from __future__ import annotations

import base64
import json
import mimetypes
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from megatron.vlm.data.messages import ImageRef
from megatron.vlm.inference.eval_task import EvalSample, is_correct
from omnibal_ext.errors import UserError

MEDIA_MODES = ("data-url", "path")


@dataclass(frozen=True)
class Prediction:
    """One answer: where it is asked, its record's number, the reference, what came back, whether it is right."""

    where: str
    record: int
    answer: str
    prediction: str
    correct: bool


@dataclass(frozen=True)
class EvalReport:
    """``backend`` that asked, the ``task`` file, its ``samples`` (answers asked) of which ``correct`` were right,
    its ``records`` of which ``records_correct`` had every answer right, and each answer's ``predictions``."""

    backend: str
    task: str
    samples: int
    correct: int
    records: int
    records_correct: int
    predictions: tuple[Prediction, ...]

    @classmethod
    def of(cls, backend: str, task: str, predictions: tuple[Prediction, ...]) -> EvalReport:
        wrong = {p.record for p in predictions if not p.correct}
        records = {p.record for p in predictions}
        return cls(backend, task, len(predictions), sum(p.correct for p in predictions), len(records),
                   len(records - wrong), predictions)

    @property
    def accuracy(self) -> float:
        """Right answers / answers."""
        return self.correct / self.samples

    @property
    def record_accuracy(self) -> float:
        """Records with every answer right / records (the trainer's teacher-forced "answer acc" counts so)."""
        return self.records_correct / self.records

    def summary(self) -> str:
        return (f"{self.backend}: {self.correct}/{self.samples} answers right (exact-match accuracy "
                f"{self.accuracy:.4f}), {self.records_correct}/{self.records} records (record accuracy "
                f"{self.record_accuracy:.4f}) on {self.task}")

    def to_json(self) -> dict:
        return {**asdict(self), "accuracy": self.accuracy, "record_accuracy": self.record_accuracy}


def openai_messages(sample: EvalSample, media: str) -> list[dict]:
    """The sample's question as OpenAI chat messages (text, ``image_url`` and ``video_url`` parts in the order
    written)."""
    def part(segment) -> dict:
        if isinstance(segment, str):
            return {"type": "text", "text": segment}
        kind = "image_url" if isinstance(segment, ImageRef) else "video_url"
        return {"type": kind, kind: {"url": _data_url(segment.path) if media == "data-url" else segment.path}}

    return [{"role": role, "content": [part(s) for s in segments]} for role, segments in sample.turns]


def _data_url(path: str) -> str:
    mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except IsADirectoryError:
        raise UserError(f"{path}: a frame folder cannot be sent as a data URL; use --media path") from None
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def connect(server: str, timeout_s: float = 600.0):
    """An ``openai`` client of ``server`` (its base URL)."""
    import openai  # the "eval" or "test" extra: only the client side of evaluation needs it

    return openai.OpenAI(base_url=server.rstrip("/") + "/v1", api_key="unused", max_retries=2, timeout=timeout_s)


def served_model_of(server: str, client=None) -> str:
    """The name of the one model ``server`` serves (refused when it lists several, or does not answer)."""
    import openai

    try:
        names = [m.id for m in (client or connect(server, 30.0)).models.list().data]
    except openai.APIConnectionError as e:
        raise UserError(f"--server {server}: no server answers there ({e})") from None
    if len(names) != 1:
        raise UserError(f"--server {server} serves {names}; name one with --served-model")
    return names[0]


def evaluate_with_client(samples: list[EvalSample], server: str, task: str, model: str | None = None,
                         max_new_tokens: int = 16, concurrency: int = 8, media: str = "data-url",
                         timeout_s: float = 600.0) -> EvalReport:
    """Ask ``server`` (its base URL, e.g. http://127.0.0.1:8000) every sample greedily and score the answers."""
    import openai

    if media not in MEDIA_MODES:
        raise UserError(f"--media {media}: expected one of {', '.join(MEDIA_MODES)}")
    client = connect(server, timeout_s)
    model = model or served_model_of(server, client)

    def ask(sample: EvalSample) -> Prediction:
        try:
            answer = client.chat.completions.create(model=model, messages=openai_messages(sample, media),
                                                    max_tokens=max_new_tokens, temperature=0)
        except openai.APIStatusError as e:
            raise UserError(f"{sample.where}: the server refused it ({e.status_code}: "
                            f"{(e.body or {}).get('message', e)})") from None
        text = answer.choices[0].message.content or ""
        return Prediction(sample.where, sample.record, sample.answer, text, is_correct(text, sample.answer))

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return EvalReport.of("omnibal", task, tuple(pool.map(ask, samples)))


def write_report(report: EvalReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=1)
