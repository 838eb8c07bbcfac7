"""MoE checkpoints across expert-parallel sizes: a run saved at EP2 resumes at EP1, and one saved at EP1 resumes at
EP2, with the losses of the uninterrupted EP1 run (the router's expert bias and the chained dense + expert optimizers'
Adam state restored: experts keyed by global expert index, whatever EP split them).

The router is DeepSeek-V3's (sigmoid scores, aux-loss-free expert bias) with a bias step large enough that the bias
moves the routing within the 4 saved iterations; the aux loss stays on."""
import pytest
import torch

from launch import checkpoint_tensors, run_training

pytestmark = pytest.mark.slow

BASE = ["--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "0",
        "--lr", "2e-3", "--log-interval", "1", "--seed", "7", "--eval-interval", "0",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--moe-layer-freq", "[1,0,1,1]",
        "--moe-aux-loss-coeff", "0.01", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05"]
EP2 = ["--expert-model-parallel-size", "2"]


def losses(records, iterations):
    by_iteration = {r["iteration"]: r["lm loss"] for r in records}
    return [by_iteration[i] for i in iterations]


def assert_close(got, want, rel):
    assert len(got) == len(want) and all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """The uninterrupted EP1 run (one rank) and an EP2 run (two ranks), each saving at iteration 4."""
    d = tmp_path_factory.mktemp("moe_ckpt")
    flags = BASE + ["--data-cache-dir", str(data_cache)]
    ep1, _ = run_training(1, flags + ["--save", str(d / "ep1"), "--save-interval", "4"], d, "ep1")
    ep2, _ = run_training(2, flags + EP2 + ["--save", str(d / "ep2"), "--save-interval", "4"], d, "ep2")
    assert [r["iteration"] for r in ep1] == [1, 2, 3, 4, 5, 6]
    return d, flags, ep1, ep2


def test_checkpoints_hold_experts_by_global_index_and_the_expert_bias(runs):
    """Both checkpoints hold the same tensors under the same keys: every expert once, by global index, EP2's
    within the EP1-vs-EP2 training tolerance of EP1's; the expert bias has moved from zero."""
    d, _, _, _ = runs
    ep1, ep2 = checkpoint_tensors(d / "ep1" / "iter_0000004"), checkpoint_tensors(d / "ep2" / "iter_0000004")
    assert ep1.keys() == ep2.keys()
    experts = [k for k in ep1 if ".mlp.experts." in k]
    assert experts and all(ep1[k].shape[0] == 4 for k in experts), experts  # [global experts, ...]
    biases = [k for k in ep1 if k.endswith("router.expert_bias")]
    assert len(biases) == 3 and all(ep1[k].abs().max() > 1e-3 for k in biases)
    for k in ep1:
        assert torch.allclose(ep1[k], ep2[k], rtol=1e-3, atol=1e-5), k


@pytest.mark.parametrize("saved,nproc,flags", [("ep2", 1, []), ("ep1", 2, EP2)], ids=["ep2-to-ep1", "ep1-to-ep2"])
def test_resume_under_another_ep_equals_uninterrupted(runs, saved, nproc, flags):
    d, base, ep1, _ = runs
    records, out = run_training(nproc, base + flags + ["--load", str(d / saved), "--ckpt-step", "4"], d,
                                f"from-{saved}")
    assert [r["iteration"] for r in records] == [5, 6]
    assert_close(losses(records, [5, 6]), losses(ep1, [5, 6]), 1e-4)


def test_distributed_optimizer_at_ep2_resumes_at_ep1(runs):
    """The distributed optimizer's chain at EP2 (dense state sharded over DP 2, expert state over expert DP 1) saved
    in megatron-core's fully reshardable form resumes as plain Adam at EP1 with the uninterrupted EP1 losses."""
    d, base, ep1, _ = runs
    run_training(2, base + EP2 + ["--use-distributed-optimizer", "--save", str(d / "ep2-distopt"),
                                  "--save-interval", "4"], d, "ep2-distopt")
    records, _ = run_training(1, base + ["--load", str(d / "ep2-distopt"), "--ckpt-step", "4"], d, "from-distopt")
    assert [r["iteration"] for r in records] == [5, 6]
    assert_close(losses(records, [5, 6]), losses(ep1, [5, 6]), 1e-4)
