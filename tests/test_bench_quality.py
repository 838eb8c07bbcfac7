"""scripts/bench_quality.py: its log parsing, aggregation and verdict on synthetic runs (hand-computed values),
its resume (a finished run is not trained again) and the plot's absence without matplotlib."""
import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_quality as bq  # noqa: E402
import benchlib as bl  # noqa: E402


def _run(config, reduction, seed, acc, loss):
    return {"config": config, "reduction": reduction, "seed": seed, "samples_seen": 24000, "final_acc": acc,
            "final_loss": loss, "train_s": 100.0 + seed, "curve": [{"samples": 24000, "train_s": 100.0, "loss": loss}]}


def _records():
    base = [(0.50, 0.60), (0.52, 0.62), (0.54, 0.64)]
    omni = [(0.53, 0.70), (0.56, 0.71), (0.59, 0.72)]
    return ([_run("baseline", "token", s, a, lo) for s, (a, lo) in zip((3, 1, 2), (base[2], base[0], base[1]))]
            + [_run("omnibal", "token", s, a, lo) for s, (a, lo) in zip((1, 2, 3), omni)])


def test_aggregate_mean_std_min_max():
    rows = bq.aggregate(_records())
    assert [(r["reduction"], r["config"], r["seeds"]) for r in rows] == [
        ("token", "baseline", [1, 2, 3]), ("token", "omnibal", [1, 2, 3])]
    b, o = rows
    # baseline acc 0.50, 0.52, 0.54: mean 0.52, sample std sqrt((0.02^2 + 0 + 0.02^2) / 2) = 0.02
    assert b["acc"] == pytest.approx({"mean": 0.52, "std": 0.02, "min": 0.50, "max": 0.54})
    assert o["acc"] == pytest.approx({"mean": 0.56, "std": 0.03, "min": 0.53, "max": 0.59})
    assert o["loss"] == pytest.approx({"mean": 0.71, "std": 0.01, "min": 0.70, "max": 0.72})
    assert b["train_s"]["mean"] == pytest.approx(102.0)


def test_verdict_against_pooled_seed_spread():
    vs = {v["metric"]: v for v in bq.verdicts(bq.aggregate(_records()))}
    # acc: pooled std sqrt((2 * 0.02^2 + 2 * 0.03^2) / 4) = sqrt(0.00065); SE = that * sqrt(2/3);
    # |0.04| < 2 SE = 0.041633: within seed noise
    acc = vs["acc"]
    assert acc["diff"] == pytest.approx(0.04)
    assert acc["pooled_std"] == pytest.approx(0.025495098)
    assert acc["se"] == pytest.approx(0.020816660)
    assert acc["differs"] is False
    # loss: pooled sqrt((2 * 0.02^2 + 2 * 0.01^2) / 4) = 0.015811; 2 SE = 0.025820 < 0.09: differs
    loss = vs["loss"]
    assert loss["diff"] == pytest.approx(0.09)
    assert loss["pooled_std"] == pytest.approx(0.015811388)
    assert loss["differs"] is True
    assert "DIFFERS" in bq.verdict_line(loss) and "within seed noise" in bq.verdict_line(acc)


def test_verdict_undetermined_with_one_seed():
    rows = bq.aggregate([_run("baseline", "square", 1, 0.5, 0.6), _run("omnibal", "square", 1, 0.6, 0.5)])
    assert rows[0]["acc"]["std"] is None
    vs = bq.verdicts(rows)
    assert [v["differs"] for v in vs] == [None, None]
    assert vs[0]["diff"] == pytest.approx(0.1)
    assert "undetermined" in bq.verdict_line(vs[0])


def test_run_record_from_the_trainer_log():
    log = [{"iteration": 1, "prefix": "", "consumed samples": 15, bl.ITER_KEY: 500.0},
           {"iteration": 2, "prefix": "", "consumed samples": 33, bl.ITER_KEY: 250.0},
           {"iteration": 2, "prefix": "validation ", "lm loss": 2.0, "token mean loss": 1.5, "answer acc": 0.25,
            "answers": 592},
           {"iteration": 3, "prefix": "", "consumed samples": 49, bl.ITER_KEY: 1000.0},
           {"iteration": 3, "prefix": "validation ", "lm loss": 1.0, "token mean loss": 0.75, "answer acc": 0.5,
            "answers": 592},
           {"iteration": 3, "prefix": "memory ", "peak_act_bytes_per_stage": [1, 2]}]
    result = bl.RunResult("x", ["--a"], [], None, "", 9.0, 0, "L", None)
    rec = bq.run_record("x", "baseline", 1, "token", result, log)
    assert [(p["iteration"], p["samples"], p["train_s"], p["loss"], p["acc"]) for p in rec["curve"]] == [
        (2, 33, pytest.approx(0.75), 1.5, 0.25), (3, 49, pytest.approx(1.75), 0.75, 0.5)]
    assert (rec["samples_seen"], rec["iterations"], rec["final_acc"], rec["final_loss"]) == (49, 3, 0.5, 0.75)
    assert rec["train_s"] == pytest.approx(1.75) and rec["recompute"] == "full"


def test_finished_run_is_reused(tmp_path, monkeypatch):
    rec = _run("baseline", "token", 1, 0.5, 0.6)
    bl.write_json(tmp_path / "runs" / "baseline_token_seed1_n64.result.json", rec)

    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(bl, "run_trainer", no_training)
    assert bq.train_one("baseline", 1, "token", 64, tmp_path, 200) == json.loads(json.dumps(rec))
    with pytest.raises(AssertionError, match="trained again"):  # another sample count is another run
        bq.train_one("baseline", 1, "token", 32, tmp_path, 200)


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert bq.plot(_records(), tmp_path / "q.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "q.png").exists()


def test_generation_accuracy_beside_teacher_forced():
    """Runs that were asked by generation get a generation-accuracy spread beside the teacher-forced one; runs
    that were not (--gen-records 0, older results) show a dash."""
    records = [{**r, "final_gen_acc": r["final_acc"] - 0.01 * (k % 2)} for k, r in enumerate(_records())]
    rows = bq.aggregate(records)
    # baseline seeds 3, 1, 2 (records 0-2): gen acc 0.54, 0.50 - 0.01, 0.52 -> mean 0.51667, min 0.49, max 0.54
    assert rows[0]["gen_acc"] == pytest.approx({"mean": 1.55 / 3, "std": rows[0]["gen_acc"]["std"], "min": 0.49,
                                                "max": 0.54})
    table = bq.markdown(rows, [])
    assert "val generation accuracy" in table.splitlines()[0]
    assert f"| {bq._cell(rows[0]['acc'])} | {bq._cell(rows[0]['gen_acc'])} |" in table
    assert bq.aggregate(_records())[0]["gen_acc"] is None
    assert "| - |" in bq.markdown(bq.aggregate(_records()), [])
