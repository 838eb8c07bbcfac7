"""profile.measure_unit on plain torch modules: saved-activation bytes equal a hand count."""
import torch

from omnibal_ext.model.profile import measure_unit


def _chain():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))


def test_linear_gelu_chain_act_bytes_hand_count():
    net = _chain()
    m = measure_unit(net, lambda: (torch.randn(16, 4, requires_grad=True),), warmup=1, repeats=3)
    # Linear1 keeps its input (16x4), GELU its input (16x8), Linear2 its input (16x8); fp32; weights excluded
    assert m.act_bytes == (16 * 4 + 16 * 8 + 16 * 8) * 4
    assert m.output_bytes == 16 * 4 * 4
    assert m.fwd_s > 0 and m.bwd_s > 0


def test_shared_storage_counted_once_and_exclude():
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        return (x @ w) * (x @ w)  # x saved by both matmuls: one storage; w passed as exclude

    make = lambda: (torch.randn(5, 8, requires_grad=True),)  # noqa: E731
    m = measure_unit(f, make, warmup=0, repeats=1, exclude=[w])
    # x (5x8) once though both matmuls save it, and the two products (5x8 each) saved by the multiplication
    assert m.act_bytes == (5 * 8 + 2 * 5 * 8) * 4
    m2 = measure_unit(f, make, warmup=0, repeats=1)
    assert m2.act_bytes == m.act_bytes + 8 * 8 * 4  # without exclude the weight counts

