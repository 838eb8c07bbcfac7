"""cpu_compat.patched(): the CPU patches hold inside the context only, nesting included; megatron-core's MoE layer
runs under them at expert parallelism 2."""
from pathlib import Path

import pytest
import torch

from megatron.training import cpu_compat

ROOT = Path(__file__).resolve().parents[1]


def patched_attributes():
    """(owner, name) of what the context patches, read from its own list."""
    return [(owner, name) for owner, name, _ in cpu_compat._patches()]


def snapshot():
    return {(id(owner), name): (name in vars(owner), vars(owner).get(name)) for owner, name in patched_attributes()}


def test_every_patched_attribute_is_restored_exactly():
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    named = [(torch.cuda, "current_device"), (torch, "zeros"), (torch.Tensor, "cuda"),
             (clip_grads, "clip_grad_by_total_norm_fp32"), (optimizer, "clip_grad_by_total_norm_fp32"),
             (DistributedOptimizer, "__init__")]
    before = {(owner, name): getattr(owner, name) for owner, name in named}
    own_before = snapshot()
    assert not cpu_compat.active()
    with cpu_compat.patched():
        assert cpu_compat.active()
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert all(getattr(owner, name) is not before[(owner, name)] for owner, name in named)
    assert not cpu_compat.active()
    assert all(getattr(owner, name) is before[(owner, name)] for owner, name in named)
    assert snapshot() == own_before  # inherited attributes (Tensor.cuda) are inherited again
    assert "cuda" not in vars(torch.Tensor)


def test_nested_contexts_share_one_set_of_patches():
    original = torch.zeros
    with cpu_compat.patched():
        outer = torch.zeros
        with cpu_compat.patched():
            assert torch.zeros is outer  # not wrapped twice
        assert torch.zeros is outer and cpu_compat.active()  # the inner exit keeps the outer's patches
    assert torch.zeros is original


def test_patched_for_a_gpu_device_patches_nothing():
    original = torch.cuda.current_device
    with cpu_compat.patched_for(torch.device("cuda")):
        assert torch.cuda.current_device is original and not cpu_compat.active()


def test_an_exception_inside_still_restores():
    original = torch.Tensor.cuda
    try:
        with cpu_compat.patched():
            raise KeyError("inside")
    except KeyError:
        pass
    assert torch.Tensor.cuda is original and not cpu_compat.active()


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_layer_at_expert_parallel_2_equals_a_plain_torch_moe(dispatcher, tmp_path):
    """megatron-core's MoELayer (SequentialMLP, top-2 softmax) at EP2 on gloo, inside the patches: each rank's output
    and its input's and experts' gradients equal a plain-torch MoE over both ranks' tokens and weights
    (tests/moe_cpu_probe.py, a case of the worker pool of 2). Without the MoE patches the alltoall dispatcher fails
    (cuda streams, split sizes) and the router raises NameError (te_general_gemm)."""
    import json

    import pool

    run = pool.run_case("moe_cpu_probe:main", [dispatcher], 2, tmp_path, timeout=180)
    assert run.returncode == 0, run.output[-3000:]
    out = "".join(run.stdout)
    reports = [json.loads(line.split("MOE_REPORT ", 1)[1]) for line in out.splitlines() if "MOE_REPORT " in line]
    assert len(reports) == 2
    for r in reports:  # relative to the reference's largest magnitude
        assert max(r.values()) <= 1e-5, r
