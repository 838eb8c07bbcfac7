"""--overlap-grad-reduce / --overlap-param-gather (megatron-core DDP buckets, async collectives) on CPU
with gloo give the losses of the synchronous run; the flags resolve to on for CUDA, off on CPU."""
import argparse

import pytest
import torch

from canonical import TINY
from launch import run_training

BASE = TINY + ["--train-iters", "5"]


def _args(**kw):
    base = dict(overlap_grad_reduce=None, overlap_param_gather=None, use_distributed_optimizer=False)
    return argparse.Namespace(**{**base, **kw})


def test_overlap_defaults_on_for_cuda_off_for_cpu():
    from megatron.training.arguments import parse_flags
    from megatron.training.flags import ArgumentError
    from megatron.training.run_plan import resolve_overlap

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_overlap(_args(), cpu) == (False, False)
    assert resolve_overlap(_args(), cuda) == (True, False)
    assert resolve_overlap(_args(use_distributed_optimizer=True), cuda) == (True, True)
    assert resolve_overlap(_args(use_distributed_optimizer=True, overlap_param_gather=False), cuda) == (True, False)
    assert resolve_overlap(_args(overlap_grad_reduce=True), cpu) == (True, False)
    assert resolve_overlap(_args(overlap_grad_reduce=False), cuda) == (False, False)
    args = parse_flags(["--no-overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather"])
    assert (args.overlap_grad_reduce, args.overlap_param_gather) == (False, True)
    with pytest.raises(ArgumentError, match="needs --use-distributed-optimizer"):
        parse_flags(["--overlap-param-gather"])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--use-distributed-optimizer"]], ids=["ddp", "distopt"])
def test_overlap_at_dp2_gives_the_same_losses(tmp_path, data_cache, flags):
    data = ["--data-cache-dir", str(data_cache)]
    plain, _ = run_training(2, BASE + data + flags, tmp_path, "plain")
    extra = ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if flags else [])
    overlap, _ = run_training(2, BASE + data + flags + extra, tmp_path, "overlap")
    assert len(plain) == len(overlap) == 5
    for a, b in zip(plain, overlap):
        assert abs(a["lm loss"] - b["lm loss"]) <= 1e-6 * abs(a["lm loss"]), (plain, overlap)
        assert abs(a["grad norm"] - b["grad norm"]) <= 1e-5 * abs(a["grad norm"])
    assert overlap[-1]["lm loss"] < overlap[0]["lm loss"]
