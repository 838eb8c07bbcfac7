"""Context parallelism (--context-parallel-size) on CPU (gloo) against the single-process run.

Each launch checks several things: losses and gradient norms of 8 iterations within 1e-4 (relative) of the
serial run, with and without ISF (which counts each sample padded to 2 x CP tokens under CP; the serial run is told
to count so), CP2 x PP2 with the ViT split over the stages, TP2 --sequence-parallel x CP2, the activation bytes
(--log-activation-memory) roughly halved at CP2, and a checkpoint saved at CP2 resumed at CP1.
"""
import json

import pytest

from act_bounds import act_ratio_range
from canonical import TINY
from launch import run_training

pytestmark = pytest.mark.slow

BASE = TINY + ["--train-iters", "8", "--log-activation-memory"]


# the serial run groups as CP2 does: each sample's tokens counted padded to 2 x CP = 4 (the CP2 run's default)
ISF = ["--omnibal-isf", "--omnibal-isf-token-multiple", "4"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_cache):
    return tmp_path_factory.mktemp("cp"), ["--data-cache-dir", str(data_cache)]


@pytest.fixture(scope="module")
def serial(workdir):
    d, data = workdir
    return {isf: run_training(1, BASE + data + (ISF if isf else []), d, f"serial-{kind(isf)}")[0]
            for isf in (False, True)}


def kind(isf: bool) -> str:
    return "isf" if isf else "random"


def assert_close(got, want, rel=1e-4):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= rel * abs(w), (got, want)


def memory_record(d, name) -> dict:
    return [json.loads(line) for line in (d / f"{name}.jsonl").read_text().splitlines()
            if json.loads(line)["prefix"] == "memory "][0]


@pytest.mark.parametrize("isf", [False, True], ids=["random", "isf"])
def test_cp2_equals_serial(workdir, serial, isf):
    d, data = workdir
    name = f"cp2-{kind(isf)}"
    records, _ = run_training(2, BASE + data + ["--context-parallel-size", "2"] + (["--omnibal-isf"] if isf else []),
                              d, name)
    want = serial[isf]
    assert [r["iteration"] for r in records] == list(range(1, 9))
    assert_close([r["lm loss"] for r in records], [r["lm loss"] for r in want])
    assert_close([r["grad norm"] for r in records], [r["grad norm"] for r in want], rel=1e-3)
    assert [r["answer acc"] for r in records] == [r["answer acc"] for r in want]
    assert [r["consumed samples"] for r in records] == [r["consumed samples"] for r in want]
    assert records[7]["lm loss"] < records[0]["lm loss"]
    # activations per rank: the LLM's tokens and the ViT's tiles are halved, the gathered K/V are not: the memory
    # model's CP2 / CP1 ratio (about half)
    cp_act = memory_record(d, name)["peak_act_bytes_per_stage"][0]
    serial_act = memory_record(d, f"serial-{kind(isf)}")["peak_act_bytes_per_stage"][0]
    lo, hi = act_ratio_range({"cp": 2}, {"cp": 1})
    assert lo < cp_act / serial_act < hi, (cp_act, serial_act, lo, hi)


def test_cp2_pp2_equals_serial_and_resumes_at_cp1(workdir, serial, tmp_path):
    """4 processes: CP2 x PP2 with the ViT split over both stages (ViT tiles travel per CP rank); its checkpoint
    of iteration 4 is resumed by the single-process run, which continues like the serial run."""
    d, data = workdir
    ckpt = tmp_path / "ckpt"
    flags = BASE + data + ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PEt*4L"]
    records, _ = run_training(4, flags + ["--context-parallel-size", "2", "--save", str(ckpt), "--save-interval", "4"],
                              d, "cp2pp2")
    assert_close([r["lm loss"] for r in records], [r["lm loss"] for r in serial[False]])
    assert_close([r["grad norm"] for r in records], [r["grad norm"] for r in serial[False]], rel=1e-3)
    resumed, out = run_training(1, BASE + data + ["--load", str(ckpt), "--ckpt-step", "4"], d, "cp1-resumed")
    assert "loaded checkpoint of iteration 4" in out
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8]
    assert_close([r["lm loss"] for r in resumed], [r["lm loss"] for r in serial[False][4:]])


def test_cp2_with_tp2_sequence_parallel_equals_serial(workdir, serial):
    """4 processes: TP2 --sequence-parallel x CP2 (every sample padded to a multiple of 2 x CP x TP = 8, pads
    masked): the serial run's losses; the per-rank activations (its memory row) against the serial run's as the
    memory model has them (CP halves the tokens, TP splits the layers' inner activations, sequence parallelism the
    replicated part: about a quarter)."""
    d, data = workdir
    records, _ = run_training(4, BASE + data + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                                "--sequence-parallel"], d, "cp2sp2")
    assert [r["iteration"] for r in records] == list(range(1, 9))
    assert_close([r["lm loss"] for r in records], [r["lm loss"] for r in serial[False]])
    assert_close([r["grad norm"] for r in records], [r["grad norm"] for r in serial[False]], rel=1e-3)
    both = memory_record(d, "cp2sp2")["peak_act_bytes_per_stage"][0]
    serial_act = memory_record(d, "serial-random")["peak_act_bytes_per_stage"][0]
    lo, hi = act_ratio_range({"tp": 2, "sequence_parallel": True, "cp": 2}, {})
    assert lo < both / serial_act < hi, (both, serial_act, lo, hi)
