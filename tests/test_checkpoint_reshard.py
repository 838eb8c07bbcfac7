"""Checkpoints resumed under another parallel configuration, against the uninterrupted run.

One run at (TP2, PP2) with a ViT-splitting layout, a recompute plan and the distributed optimizer trains 6
iterations, saving at iteration 4. Resumed from that checkpoint under other (TP, PP, DP), layouts,
recompute plans and optimizer kinds, iterations 5 and 6 must log the uninterrupted run's losses; the
weights a resharded run loads must be the saved ones, bit for bit (a resumed run with nothing left to train
saves what it loaded, and both checkpoints' tensors are compared).
"""
import pytest
import torch

from launch import checkpoint_tensors, run_training

pytestmark = pytest.mark.slow

BASE = ["--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr-warmup-iters", "0",
        "--lr", "2e-3", "--seed", "11", "--eval-interval", "0"]
SAVED_AT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--pipeline-layout", "Iv*2|v*2PEt*4L", "--recompute-plan=v1|t2s", "--use-distributed-optimizer"]


def losses(records, iterations):
    by_iteration = {r["iteration"]: r["lm loss"] for r in records}  # a resumed log repeats nothing here
    return [by_iteration[i] for i in iterations]


def assert_close(got, want, rel):
    assert all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, data_cache):
    d = tmp_path_factory.mktemp("reshard")
    flags = BASE + ["--data-cache-dir", str(data_cache)]
    records, _ = run_training(4, flags + SAVED_AT + ["--save", str(d / "ckpt"), "--save-interval", "4"], d, "saved")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    return d, flags, losses(records, [5, 6])


@pytest.mark.parametrize("nproc,flags", [
    (1, []),  # TP1 PP1, plain Adam from the distributed optimizer's state
    (4, ["--pipeline-model-parallel-size", "4", "--pipeline-layout", "Iv*3|vP|Et*2|t*2L", "--recompute-plan=v2|-|t1s|t2"]),
    (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),  # TP2 DP2
], ids=["tp1pp1", "pp4-other-layout-recompute", "tp2dp2-distopt"])
def test_resume_resharded_equals_uninterrupted(saved, nproc, flags):
    d, base, want = saved
    records, out = run_training(nproc, base + flags + ["--load", str(d / "ckpt"), "--ckpt-step", "4"], d, "resumed")
    assert "resharded" in out
    assert [r["iteration"] for r in records] == [5, 6]
    assert_close(losses(records, [5, 6]), want, 1e-4)


def test_loaded_weights_are_the_saved_ones_and_plain_adam_feeds_the_distributed_optimizer(saved):
    """A TP1/PP1 run resumed with nothing left to train saves what it loaded: the same model tensors as the
    (TP2, PP2) checkpoint, bit for bit. That plain-Adam copy resumes a distributed-optimizer run at PP2 x DP2."""
    d, base, want = saved
    copy = d / "copy"
    _, out = run_training(1, base + ["--train-iters", "4", "--use-checkpoint-opt_param-scheduler", "--load",
                                     str(d / "ckpt"), "--ckpt-step", "4", "--save", str(copy)], d, "copy")
    assert (f"> nothing to train: the run starts at iteration 4 and --train-iters is 4 (the checkpoint is saved to "
            f"--save {copy} as it is)") in out
    original, copied = checkpoint_tensors(d / "ckpt" / "iter_0000004"), checkpoint_tensors(copy / "iter_0000004")
    assert original.keys() == copied.keys() and len(original) > 50
    assert all(torch.equal(original[k], copied[k]) for k in original)
    records, _ = run_training(4, base + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                         "--load", str(copy)], d, "from-copy")
    assert_close(losses(records, [5, 6]), want, 1e-4)


def test_padded_vit_heads_load_at_any_tp(tmp_path, data_cache):
    """A ViT of 3 heads saved at TP2 (padded to 4) resumes at TP1 and TP4 (padded to 4 again, one real head
    per rank but the last) with the uninterrupted losses; the checkpoint holds the 3 real heads only."""
    model = ["--vision-hidden-size", "48", "--vision-num-attention-heads", "3", "--num-query-groups", "4"]
    flags = BASE + model + ["--data-cache-dir", str(data_cache)]
    full, _ = run_training(2, flags + ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "c"),
                                       "--save-interval", "4"], tmp_path, "tp2")
    qkv = checkpoint_tensors(tmp_path / "c" / "iter_0000004")["vit.layer.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (3, 3 * 16, 48)  # [real heads, q|k|v rows of one head, hidden]
    for nproc, tp in ((1, "1"), (4, "4")):
        records, _ = run_training(nproc, flags + ["--tensor-model-parallel-size", tp, "--load", str(tmp_path / "c"),
                                                  "--ckpt-step", "4"], tmp_path, f"tp{tp}")
        assert_close(losses(records, [5, 6]), losses(full, [5, 6]), 1e-5)
