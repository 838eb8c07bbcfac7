"""``omnibal eval --backend lmms-eval``: the local task written as an lmms-eval task, and lmms-eval run against the
server from its own Python environment.

lmms-eval 0.7.3 pins ``av<16``, ``torchvision`` and ``wandb==0.25.0``, which this project's environment cannot hold
(``av==18.1.0``; torchvision does not load with this CPU torch), so it lives in a virtual environment of its own
(``--lmms-eval-python VENV/bin/python``) and talks to ``omnibal serve`` over HTTP through its ``openai`` model
(greedy, ``max_new_tokens``).

The task folder (``write_lmms_task``) holds ``omnibal_local.yaml`` (``dataset_path: json`` over ``data.jsonl``, no hub
download), ``utils.py`` (the images of a row, its question) and ``data.jsonl``.  lmms-eval builds each question as one
user message, its images first, then the text: a record it cannot put that way (a system turn, several turns, a
video, text before an image) is refused, naming it, rather than evaluated differently.  Its metric is
``exact_match`` with the options ``eval_task.normalize_answer`` follows.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
from dataclasses import dataclass

from megatron.vlm.data.messages import ImageRef
from megatron.vlm.inference.eval_task import EvalSample
from megatron.vlm.inference.evaluate import EvalReport, Prediction
from omnibal_ext.errors import UserError

TASK_NAME = "omnibal_local"
METRIC = "exact_match"

TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  temperature: 0
  do_sample: false
metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore:
      - "^\\\\s+|\\\\s+$"
"""

TASK_UTILS = '''\
"""Rows of data.jsonl: {"images": [absolute paths], "question": str, "answer": str} (written by omnibal eval)."""
from PIL import Image


def doc_to_visual(doc):
    images = []
    for path in doc["images"]:
        with Image.open(path) as image:
            image.load()
        images.append(image)
    return images


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]
'''


@dataclass(frozen=True)
class LmmsEvalRun:
    """How to run lmms-eval: its environment's ``python``, the task folder ``work_dir`` (its results land in
    ``work_dir/results``), requests in flight (``concurrency``) and the run's time limit."""

    python: str
    work_dir: str
    concurrency: int = 8
    timeout_s: float = 3600.0


def lmms_row(sample: EvalSample) -> dict:
    """The sample as an lmms-eval row, or ``UserError`` where lmms-eval would ask something else."""
    if len(sample.turns) != 1 or sample.turns[0][0] != "user":  # a system turn, or an answer after the first
        raise UserError(f"{sample.where}: lmms-eval asks one user message; this record has "
                        f"{[role for role, _ in sample.turns]} before its answer (use --backend omnibal)")
    segments = sample.turns[0][1]
    images = [s.path for s in segments if isinstance(s, ImageRef)]
    texts = [s for s in segments if isinstance(s, str)]
    if len(images) + len(texts) != len(segments):
        raise UserError(f"{sample.where}: a video; lmms-eval's openai model sends videos as frames or as "
                        "vLLM-only options (use --backend omnibal)")
    if any(isinstance(s, str) for s in segments[:len(images)]):
        raise UserError(f"{sample.where}: text before an image; lmms-eval puts the images first "
                        "(use --backend omnibal, or write the images first)")
    return {"images": images, "question": "".join(texts), "answer": sample.answer}


def write_lmms_task(samples: list[EvalSample], folder: str, max_new_tokens: int) -> str:
    """Write the task folder (see the module docstring); returns it."""
    rows = [lmms_row(s) for s in samples]  # every refusal before anything is written
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(os.path.abspath(folder), "data.jsonl")
    with open(data, "w") as f:
        for k, row in enumerate(rows):
            f.write(json.dumps({"id": k, **row}) + "\n")
    with open(os.path.join(folder, f"{TASK_NAME}.yaml"), "w") as f:
        f.write(TASK_YAML.format(task=TASK_NAME, data=json.dumps(data), max_new_tokens=max_new_tokens,
                                 metric=METRIC))
    with open(os.path.join(folder, "utils.py"), "w") as f:
        f.write(TASK_UTILS)
    return folder


def lmms_eval_command(run: LmmsEvalRun, server: str, model: str) -> list[str]:
    """lmms-eval's command line for the task folder against ``server``'s ``model``."""
    model_args = (f"model_version={model},base_url={server.rstrip('/')}/v1,api_key=unused,"
                  f"num_concurrent={run.concurrency},max_retries=1,timeout=600")
    return [run.python, "-m", "lmms_eval", "eval", "--model", "openai", "--model_args", model_args,
            "--tasks", TASK_NAME, "--include_path", os.path.abspath(run.work_dir), "--batch_size", "1",
            "--output_path", os.path.join(os.path.abspath(run.work_dir), "results"), "--log_samples"]


def run_lmms_eval(samples: list[EvalSample], task: str, server: str, model: str, run: LmmsEvalRun,
                  max_new_tokens: int = 16) -> EvalReport:
    """Write the task, run lmms-eval on it (offline: no hub access) and read its score back."""
    if not os.path.isfile(run.python) or not os.access(run.python, os.X_OK):
        raise UserError(f"--lmms-eval-python {run.python}: no such interpreter (create the environment first: "
                        "docs/generation.md#evaluation)")
    write_lmms_task(samples, run.work_dir, max_new_tokens)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "OPENAI_API_KEY": "unused", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # its own environment, not this project's
    command = lmms_eval_command(run, server, model)
    with open(os.path.join(run.work_dir, "lmms_eval.log"), "w") as log:
        done = subprocess.run(command, cwd=run.work_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=run.timeout_s)
    if done.returncode != 0:
        raise UserError(f"lmms-eval exited with status {done.returncode}; its output is in "
                        f"{os.path.join(run.work_dir, 'lmms_eval.log')}")
    return EvalReport.of("lmms-eval", task, read_lmms_predictions(run.work_dir, samples))


def read_lmms_predictions(work_dir: str, samples: list[EvalSample]) -> tuple[Prediction, ...]:
    """Each sample's answer and score from lmms-eval's newest run under ``work_dir/results`` (its samples JSONL,
    checked against its aggregate score)."""
    log = os.path.join(work_dir, "lmms_eval.log")
    found = sorted(glob.glob(os.path.join(work_dir, "results", "**", "*_results.json"), recursive=True),
                   key=os.path.getmtime)
    if not found:
        raise UserError(f"lmms-eval wrote no results under {work_dir}/results; its output is in {log}")
    run = found[-1][:-len("_results.json")]
    with open(found[-1]) as f:
        score = float(json.load(f)["results"][TASK_NAME][f"{METRIC},none"])
    with open(f"{run}_samples_{TASK_NAME}.jsonl") as f:
        rows = sorted((json.loads(line) for line in f if line.strip()), key=lambda row: row["doc_id"])
    if [row["doc_id"] for row in rows] != list(range(len(samples))):
        raise UserError(f"lmms-eval answered {len(rows)} of the {len(samples)} samples; its output is in {log}")
    answers = [row["filtered_resps"] for row in rows]  # a string, or a list of one (filters kept apart)
    answers = [a[0] if isinstance(a, list) else a for a in answers]
    predictions = tuple(Prediction(s.where, s.record, s.answer, answer, row[METRIC] == 1.0)
                        for s, answer, row in zip(samples, answers, rows))
    if abs(sum(p.correct for p in predictions) / len(samples) - score) > 1e-9:
        raise RuntimeError(f"lmms-eval's score {score} is not the mean of its samples' {METRIC} ({run})")
    return predictions
