"""`omnibal eval` against a server on loopback with the stand-in generator (tests/standin_generator.py), on a
24-sample local task whose right answers are known by construction (tests/eval_tasks.py)."""
from __future__ import annotations

import json
import os

import pytest

import standin_generator as standin
from eval_tasks import write_colour_task
from megatron.vlm.inference.eval_task import EvalTaskError, read_task
from megatron.vlm.inference.lmms_eval_task import lmms_row
from megatron.vlm.inference.server import ServerConfig, serving_in_background
from omnibal_cli import main as omnibal
from omnibal_ext.errors import UserError

LMMS_EVAL_PYTHON = os.environ.get("OMNIBAL_LMMS_EVAL_PYTHON")  # lmms-eval's own environment, where one exists


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return write_colour_task(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def server():
    with serving_in_background(standin.served(), standin.StandInGenerator().generate,
                               ServerConfig(port=0, max_batch_size=8)) as url:
        yield url


def run_eval(tmp_path, task_path, server, *flags) -> dict:
    report = tmp_path / "report.json"
    assert omnibal(["eval", "--task", str(task_path), "--server", server, "--max-new-tokens", "64",
                    "--output", str(report), *flags]) == 0
    return json.loads(report.read_text())


def test_eval_scores_each_sample(tmp_path, task, server, capsys):
    """Every sample's verdict is the one built into the task (references differing in case, punctuation and outer
    spaces count as right); sending paths instead of data URLs changes nothing."""
    task_path, right = task
    report = run_eval(tmp_path, task_path, server)
    assert [p["correct"] for p in report["predictions"]] == right
    assert (report["samples"], report["correct"], report["accuracy"]) == (24, 12, 0.5)
    assert "omnibal: 12/24 answers right (exact-match accuracy 0.5000), 12/24 records" in capsys.readouterr().out
    by_path = run_eval(tmp_path, task_path, server, "--media", "path", "--limit", "6")
    assert by_path["predictions"] == report["predictions"][:6]


@pytest.mark.skipif(LMMS_EVAL_PYTHON is None, reason="OMNIBAL_LMMS_EVAL_PYTHON names no lmms-eval environment")
def test_lmms_eval_agrees(tmp_path, task, server):
    """lmms-eval, from its own environment, asks the same questions and gets the same answers and verdicts."""
    task_path, right = task
    ours = run_eval(tmp_path, task_path, server)
    theirs = run_eval(tmp_path, task_path, server, "--backend", "lmms-eval", "--lmms-eval-python",
                      LMMS_EVAL_PYTHON, "--work-dir", str(tmp_path / "lmms"))
    assert [p["prediction"] for p in theirs["predictions"]] == [p["prediction"] for p in ours["predictions"]]
    assert [p["correct"] for p in theirs["predictions"]] == right and theirs["accuracy"] == 0.5


def test_eval_refusals(tmp_path, task, server, capsys):
    task_path, _ = task
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: the last user message has no assistant answer"):
        read_task(str(bad))
    with pytest.raises(EvalTaskError, match=r"nothing.jsonl: cannot read it"):
        read_task(str(tmp_path / "nothing.jsonl"))
    assert omnibal(["eval", "--task", str(task_path), "--backend", "lmms-eval"]) == 1
    assert omnibal(["eval", "--task", str(task_path), "--server", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("omnibal eval: error: --backend lmms-eval needs --lmms-eval-python")
    assert err[1].startswith("omnibal eval: error: --server http://127.0.0.1:9: no server answers there")

    video = tmp_path / "video.jsonl"
    video.write_text(json.dumps({"messages": [{"role": "user", "content": "<video>what?"},
                                              {"role": "assistant", "content": "a"}], "videos": ["v.mp4"]}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": [
                         {"type": "text", "text": "see"}, {"type": "image", "image": "a.png"}]},
                         {"role": "assistant", "content": "a"}]}) + "\n")
    first, second = read_task(str(video))
    with pytest.raises(ValueError, match="video.jsonl:1: a video"):
        lmms_row(first)
    with pytest.raises(ValueError, match="video.jsonl:2: text before an image"):
        lmms_row(second)
    assert lmms_row(read_task(str(task_path), limit=1)[0])["images"] == [str(task_path.parent / "images/c0.png")]


def test_several_answers_per_record(tmp_path, task, server):
    """An InternVL `conversations` record with two answers is two questions, the second asked after the first
    turn pair as written; a record counts right only when both answers are."""
    image = task[0].parent / "images" / "c0.png"
    said = "image 16x16 rgb(0,255,0) ba"
    records = [{"image": str(image), "conversations": [
                    {"from": "human", "value": "<image>\nab"}, {"from": "gpt", "value": said},
                    {"from": "human", "value": "cd"}, {"from": "gpt", "value": ans}]}
               for ans in ("dc", "wrong")]
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    first, second = read_task(str(path))[:2]
    assert (first.record, second.record, second.where) == (0, 0, f"{path}:1 (answer 2)")
    assert [role for role, _ in second.turns] == ["user", "assistant", "user"]
    assert second.turns[0][1][0].path == str(image) and second.turns[1][1] == (said,)
    report = run_eval(tmp_path, path, server)
    assert [p["correct"] for p in report["predictions"]] == [True, True, True, False]
    assert (report["correct"], report["records"], report["records_correct"]) == (3, 2, 1)
