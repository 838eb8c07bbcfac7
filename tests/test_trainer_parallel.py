"""Multi-process training on CPU (gloo) against the single-process run.

Each torchrun launch costs seconds, so each checks several things: parallel equals serial
(losses of 5 iterations within 1e-4 relative), recompute changes nothing, resume is exact.
"""
import json
import re

import pytest

from canonical import TINY
from launch import checkpoint_tensors, run_training

pytestmark = pytest.mark.slow

BASE = TINY + ["--train-iters", "6"]  # served by the canonical 8-iteration serial run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_cache):
    d = tmp_path_factory.mktemp("parallel")
    return d, ["--data-cache-dir", str(data_cache)]


@pytest.fixture(scope="module")
def serial(workdir, serial_run):
    _, data = workdir
    records = serial_run(BASE + data)  # shared with test_trainer_tied's untied run
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    return records


def losses(records, n=5):
    return [r["lm loss"] for r in records[:n]]


def assert_close(got, want, rel=1e-4):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= rel * abs(w), (got, want)


@pytest.mark.parametrize("nproc,flags", [
    (2, ["--tensor-model-parallel-size", "2"]),
    (2, ["--pipeline-model-parallel-size", "2"]),
    (2, []),  # DP=2
    (4, ["--pipeline-model-parallel-size", "2"]),  # PP=2 x DP=2
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PEt*4L"]),  # ViT split over stages
], ids=["tp2", "pp2", "dp2", "pp2dp2", "pp2-vit-split"])
def test_parallel_equals_serial(workdir, serial, shared_runs, nproc, flags):
    _, data = workdir
    records, _, _ = shared_runs.run(nproc, BASE + data + flags)  # pp2dp2: test_resume_is_exact's uninterrupted run
    assert_close(losses(records), losses(serial))
    assert_close([r["grad norm"] for r in records[:5]], [r["grad norm"] for r in serial[:5]], rel=1e-3)
    assert all(r["global batch size"] == 8 for r in records)
    # the loss really moves: a run that ignored its data or weights could not match 5 iterations
    assert records[4]["lm loss"] < records[0]["lm loss"]


def test_recompute_changes_nothing(workdir, serial):
    """One launch, both kinds: full recompute of stage 0's ViT and LLM layers, selective of stage 1's."""
    d, data = workdir
    flags = ["--pipeline-model-parallel-size", "2", "--recompute-plan=v4,t2|t2s"]
    records, out = run_training(2, BASE + data + flags, d, "recompute")
    assert_close(losses(records, 6), losses(serial, 6), rel=1e-5 * 10)
    assert_close([r["grad norm"] for r in records], [r["grad norm"] for r in serial], rel=1e-4)


def test_resume_is_exact(workdir, shared_runs, tmp_path):
    d, data = workdir
    flags = BASE + data + ["--pipeline-model-parallel-size", "2"]
    full, _, _ = shared_runs.run(4, flags)  # test_parallel_equals_serial[pp2dp2]'s run
    ckpt = tmp_path / "ckpt"
    first, _ = run_training(4, flags + ["--save", str(ckpt), "--exit-interval", "3"], d, "first")
    assert [r["iteration"] for r in first] == [1, 2, 3]
    second, _ = run_training(4, flags + ["--load", str(ckpt)], d, "second")
    assert [r["iteration"] for r in second] == [4, 5, 6]
    assert [r["lm loss"] for r in first + second] == [r["lm loss"] for r in full]
    assert [r["consumed samples"] for r in first + second] == [r["consumed samples"] for r in full]


def test_resume_with_distributed_optimizer_is_exact(workdir, serial, tmp_path):
    """The distributed optimizer (DP=2) trains like the serial run, and its sharded Adam state is saved
    and restored: a resumed run matches the uninterrupted one exactly (losing the moments, or
    sharing one Adam step counter between parameters, changes iterations 5 and 6)."""
    d, data = workdir
    flags = BASE + data + ["--use-distributed-optimizer"]
    full, _ = run_training(2, flags, d, "dist-full")
    assert_close(losses(full), losses(serial))
    ckpt = tmp_path / "ckpt"
    first, _ = run_training(2, flags + ["--save", str(ckpt), "--exit-interval", "3"], d, "dist-first")
    second, _ = run_training(2, flags + ["--load", str(ckpt)], d, "dist-second")
    assert [r["iteration"] for r in second] == [4, 5, 6]
    assert [r["lm loss"] for r in first + second] == [r["lm loss"] for r in full]
    assert [r["grad norm"] for r in first + second] == [r["grad norm"] for r in full]


def test_partition_auto_equals_serial(workdir, serial):
    """--omnibal-partition auto profiles, searches and applies a layout; training is unchanged."""
    d, data = workdir
    records, out = run_training(2, BASE + data + ["--pipeline-model-parallel-size", "2", "--omnibal-partition", "auto"],
                                d, "partition")
    assert "> omnibal partition: layout " in out
    assert_close(losses(records), losses(serial))


def _memory_record(workdir, name, budget_gib, serial):
    d, data = workdir
    flags = BASE + data + ["--pipeline-model-parallel-size", "2", "--omnibal-recompute", "auto",
                           "--omnibal-memory-budget", str(budget_gib)]
    records, out = run_training(2, flags, d, name)
    assert_close(losses(records, 6), losses(serial, 6))  # recompute never changes the numbers
    assert_close([r["grad norm"] for r in records], [r["grad norm"] for r in serial], rel=1e-4)
    memory = [json.loads(line) for line in (d / f"{name}.jsonl").read_text().splitlines()
              if json.loads(line)["prefix"] == "memory "][0]
    plan = re.search(r"> omnibal recompute: plan (\S+)", out).group(1)
    return memory, plan


def test_adaptive_recompute_fits_the_budget(workdir, serial):
    loose, loose_plan = _memory_record(workdir, "loose", 1.0, serial)
    assert loose_plan == "-|-"  # everything fits: no recompute at all
    # a budget between the no-recompute and full-recompute needs of stage 0
    tight_gib = 0.0084
    tight, tight_plan = _memory_record(workdir, "tight", tight_gib, serial)
    assert tight_plan != "-|-" and tight_plan.split("|")[0] != "-"
    for mem, budget in ((loose, 1.0 * 2**30), (tight, tight_gib * 2**30)):
        for act, static in zip(mem["peak_act_bytes_per_stage"], mem["static_bytes_per_stage"]):
            assert 0 < act and act + static <= budget
    # the tight plan keeps fewer activations on stage 0 than no recompute does
    assert tight["peak_act_bytes_per_stage"][0] < loose["peak_act_bytes_per_stage"][0]


def test_vit_heads_padded_for_tensor_parallel(workdir, tmp_path):
    """3 ViT heads at TP 2 run as 4, the fourth zero: losses and gradient norms equal the serial 3-head
    run's (a padded head that took any gradient would change the norm), and the checkpoint holds the 3
    real heads only, trained."""
    import torch

    d, data = workdir
    flags = BASE + data + ["--vision-hidden-size", "48", "--vision-num-attention-heads", "3"]
    serial3, _ = run_training(1, flags, d, "vit3-serial")
    ckpt = tmp_path / "ckpt"
    tp2, _ = run_training(2, flags + ["--tensor-model-parallel-size", "2", "--save", str(ckpt), "--exit-interval", "6"],
                          d, "vit3-tp2")
    assert_close(losses(tp2, 6), losses(serial3, 6))
    assert_close([r["grad norm"] for r in tp2], [r["grad norm"] for r in serial3], rel=1e-3)
    saved = checkpoint_tensors(ckpt / "iter_0000006")
    for layer in range(4):
        qkv = saved[f"vit.layer.{layer}.self_attention.linear_qkv.weight"]
        assert qkv.shape == (3, 3 * 16, 48)  # [real heads, q|k|v rows of a head, hidden]
        assert all(torch.count_nonzero(qkv[h]) > 0 for h in range(3))
