"""cpu_compat.patched(): the CPU patches hold inside the context only, nesting included."""
import torch

from megatron.training import cpu_compat


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
