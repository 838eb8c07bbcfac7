"""The allgather token dispatcher (--moe-token-dispatcher-type allgather: megatron/vlm/layers/moe.py's
PaddedAllGatherTokenDispatcher, each rank's tokens padded to the expert TP x EP group's largest count and the pads
routed nowhere) against the single-process run: EP2 (the two data-parallel ranks' micro-batches differ in length)
and TP2 + SP. Losses, gradient norms, the logged aux loss and expert load within 1e-4 / 1e-3 for 6 iterations."""
import pytest
import torch

from canonical import TINY_MOE

# test_moe_training.py's flags: its serial reference is shared in a session
BASE = TINY_MOE + ["--train-iters", "6"]


def assert_close(got, want, rel):
    assert len(got) == len(want) and all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want)


def build_moe_mlp(dispatcher: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.vlm.layers.moe import MoERun, config_fields, layer_spec
    from omnibal_ext.model.moe import MoESpec

    moe = MoESpec(num_experts=4, topk=2, ffn_hidden_size=24, layer_freq=(1,))
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                               add_bias_linear=False, variable_seq_lengths=True,
                               **config_fields(moe, MoERun(dispatcher=dispatcher), 1))
    spec = layer_spec(get_gpt_layer_local_spec(), 4, "RMSNorm", dispatcher)
    torch.manual_seed(3)
    return build_module(spec.submodules.mlp, config=config).train()


def test_allgather_layer_routes_as_alltoall(megatron_world):
    """One process: the allgather layer (megatron-core's config told alltoall, which refuses allgather with
    variable sequence lengths) holds the padded allgather dispatcher, the same weights, and computes the alltoall
    layer's output and gradients."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron.vlm.layers.moe import PaddedAllGatherTokenDispatcher

    layers = {d: build_moe_mlp(d) for d in ("alltoall", "allgather")}
    assert type(layers["allgather"].token_dispatcher) is PaddedAllGatherTokenDispatcher
    assert type(layers["alltoall"].token_dispatcher) is MoEAlltoAllTokenDispatcher
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(1))
    out = {}
    for d, layer in layers.items():
        h = x.clone().requires_grad_()
        y, _ = layer(h)
        y.square().sum().backward()
        out[d] = (y.detach(), h.grad, {n: p.grad for n, p in layer.named_parameters()})
    torch.testing.assert_close(out["allgather"][0], out["alltoall"][0])
    torch.testing.assert_close(out["allgather"][1], out["alltoall"][1])
    assert out["allgather"][2].keys() == out["alltoall"][2].keys()
    for n, g in out["alltoall"][2].items():
        torch.testing.assert_close(out["allgather"][2][n], g, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--expert-model-parallel-size", "2"],
                                   ["--tensor-model-parallel-size", "2", "--sequence-parallel"]], ids=["ep2", "tp2-sp"])
def test_allgather_equals_serial(data_cache, serial_run, shared_runs, flags):
    data = ["--data-cache-dir", str(data_cache)]
    serial = serial_run(BASE + data)
    records, _, _ = shared_runs.run(2, BASE + data + flags + ["--moe-token-dispatcher-type", "allgather"])
    for key, rel in (("lm loss", 1e-4), ("grad norm", 1e-3), ("moe aux loss", 1e-4), ("expert load imbalance", 1e-6)):
        assert_close([r[key] for r in records], [r[key] for r in serial], rel)
    assert records[5]["lm loss"] < records[0]["lm loss"]
