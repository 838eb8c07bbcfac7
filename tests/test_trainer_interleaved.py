"""The interleaved (virtual) pipeline against independent runs: PP2 with the four-stage layout
``Iv*2|v*2PE|t*2|t*2L`` (V = 2: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3) under megatron-core's
interleaved 1F1B schedule.

* losses of 8 iterations within 1e-4 of the serial run, with and without --omnibal-isf;
* its checkpoint (iteration 4) resumes in a plain PP2 layout with the uninterrupted losses (1e-3), and that
  run's checkpoint (iteration 6) resumes interleaved again: checkpoints do not depend on V;
* --log-activation-memory: each interleaved rank holds the units of its two chunks, and its static bytes are
  the sum of those of the same two stages run as a plain PP4 pipeline.
"""
import json

import pytest

from canonical import TINY
from launch import checkpoint_tensors, run_training

pytestmark = pytest.mark.slow

BASE = TINY + ["--train-iters", "8"]
LAYOUT = "Iv*2|v*2PE|t*2|t*2L"
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--pipeline-layout", LAYOUT]
PLAIN = ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PEt*4L"]


def losses(records, iterations):
    by_iteration = {r["iteration"]: r["lm loss"] for r in records}
    return [by_iteration[i] for i in iterations]


def assert_close(got, want, rel):
    assert len(got) == len(want)
    assert all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want)


def memory_row(log):
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["prefix"] == "memory "][0]


def interleaved_run(shared_runs, flags, save):
    """(records, output, JSON log) of the 2-process interleaved run of ``flags``, launched once per session; with
    ``save``: it also saves iteration 4 (under shared_runs.folder / "v2") and logs its activation memory."""
    extra = ["--save", str(shared_runs.folder / "v2"), "--save-interval", "4", "--log-activation-memory"] if save else []
    return shared_runs.run(2, flags + INTERLEAVED + extra)


@pytest.mark.parametrize("isf", [False, True], ids=["random", "isf"])
def test_interleaved_equals_serial(data_cache, shared_runs, serial_run, isf):
    flags = BASE + ["--data-cache-dir", str(data_cache)] + (["--omnibal-isf"] if isf else [])
    serial = serial_run(flags)  # the session's serial run of these flags (shared with test_sequence_parallel)
    records, out, _ = interleaved_run(shared_runs, flags, save=not isf)  # random: the checkpoint test's V = 2 run
    assert f"layout {LAYOUT}, interleaved: 2 model chunks per rank," in out
    iterations = list(range(1, 9))
    assert [r["iteration"] for r in records] == iterations
    assert_close(losses(records, iterations), losses(serial, iterations), 1e-4)
    assert_close([r["grad norm"] for r in records], [r["grad norm"] for r in serial], 1e-3)
    assert records[-1]["lm loss"] < records[0]["lm loss"]
    if isf:
        assert all(r["pad ratio"] == 0.0 for r in records)


def test_interleaved_checkpoints_and_memory(tmp_path, data_cache, shared_runs):
    d = tmp_path
    flags = BASE + ["--data-cache-dir", str(data_cache)]
    full, _, log = interleaved_run(shared_runs, flags, save=True)  # shared with test_interleaved_equals_serial
    v2_ckpt = shared_runs.folder / "v2"
    # V = 2 -> V = 1: the plain PP2 layout resumes iteration 4 with the uninterrupted losses
    plain, out = run_training(2, flags + PLAIN + ["--load", str(v2_ckpt), "--ckpt-step", "4", "--save", str(d / "v1"),
                                                  "--save-interval", "6"], d, "v1")
    assert [r["iteration"] for r in plain] == [5, 6, 7, 8]
    assert_close(losses(plain, [5, 6, 7, 8]), losses(full, [5, 6, 7, 8]), 1e-3)
    # V = 1 -> V = 2: back from the plain run's iteration 6
    back, _ = run_training(2, flags + INTERLEAVED + ["--load", str(d / "v1"), "--ckpt-step", "6"], d, "back")
    assert [r["iteration"] for r in back] == [7, 8]
    assert_close(losses(back, [7, 8]), losses(full, [7, 8]), 1e-3)
    # the same tensors under the same keys, whatever V
    v2, v1 = checkpoint_tensors(v2_ckpt / "iter_0000004"), checkpoint_tensors(d / "v1" / "iter_0000006")
    assert v2.keys() == v1.keys() and len(v2) > 50
    assert all(v2[k].shape == v1[k].shape for k in v2)

    # memory: rank r holds the units of stages r and r + 2; its static bytes are those of PP4's stages r and r + 2
    memory = memory_row(log)
    assert memory["layout_stages_per_rank"] == [[0, 2], [1, 3]]
    vit = [f"vit.layer.{i}" for i in range(4)]
    llm = [f"llm.layer.{i}" for i in range(4)]
    assert memory["units_per_rank"] == [["vit.embed", *vit[:2], *llm[:2]],
                                        [*vit[2:], "projector", "llm.embed", *llm[2:], "llm.head"]]
    run_training(4, flags + ["--train-iters", "1", "--pipeline-model-parallel-size", "4", "--pipeline-layout", LAYOUT,
                             "--log-activation-memory"], d, "pp4")
    pp4 = memory_row(d / "pp4.jsonl")
    static = pp4["static_bytes_per_stage"]
    assert memory["static_bytes_per_stage"] == [static[0] + static[2], static[1] + static[3]]
    assert all(a > 0 for a in memory["peak_act_bytes_per_stage"])


def test_interleaved_with_tp2_sequence_parallel_equals_serial(tmp_path, data_cache, serial_run):
    """4 processes: TP2 --sequence-parallel x PP2 interleaved (V = 2): split hidden states travel between the
    chunks of a block (ViT and LLM stages on both ranks); the serial run's losses within 1e-4."""
    flags = BASE + ["--data-cache-dir", str(data_cache)]
    serial = serial_run(flags)
    records, out = run_training(4, flags + INTERLEAVED + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                tmp_path, "sp-interleaved")
    assert f"layout {LAYOUT}, interleaved: 2 model chunks per rank," in out
    iterations = list(range(1, 9))
    assert [r["iteration"] for r in records] == iterations
    assert_close(losses(records, iterations), losses(serial, iterations), 1e-4)
    assert_close([r["grad norm"] for r in records], [r["grad norm"] for r in serial], 1e-3)
