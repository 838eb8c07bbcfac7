"""The memory model of the Qwen3 and Qwen3.5 LLM layers against the bytes autograd saves (the trainer's profiler,
world of one): the Qwen3 decoder layer with its per-head q/k norms (qwen3-vl-tiny), and Qwen3.5's Gated DeltaNet
and gated-attention layers (partial rotary, the gate, zero-centred norms) and its head (qwen3.5-tiny), every
recompute mode, on a row of three samples (a shape that names several samples: each sample's attention output is
kept beside their concatenation). Exact: each term of the model is a tensor the layer keeps."""
import pytest
import torch

from megatron.training.flags import build_parser
from megatron.training.specs import run_config
from omnibal_ext.model.cost_model import DEVICES, MicroBatchShape, analytic_costs
from omnibal_ext.model.units import get_preset

SHAPE = MicroBatchShape(vision_items=32, llm_tokens=120, dtype_bytes=4, vision_attn_tokens_sq=2 * 16.0 ** 2,
                        llm_attn_tokens_sq=3 * 40.0 ** 2)
CASES = {"qwen3-vl-tiny": ("llm_layer", "llm_head"),
         "qwen3.5-tiny": ("qwen3_5_linear_layer", "qwen3_5_attention_layer", "llm_head")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_llm_layers_keep_what_the_memory_model_counts(megatron_world, name):
    from megatron.training.profiling import profile_units

    spec = get_preset(name)
    args = build_parser().parse_args(["--seed", "1"])
    measured = {u.kind: u for u in profile_units(run_config(args, 1), spec, SHAPE, 250, torch.device("cpu"), warmup=0,
                                                 repeats=1).units}
    model = {u.kind: u for u in analytic_costs(spec, SHAPE, 1, DEVICES["cpu"], attention="flash").units}
    for kind in CASES[name]:
        got, want = measured[kind], model[kind]
        assert got.act_bytes == want.act_bytes, (kind, got.act_bytes, want.act_bytes)
        if kind == "llm_head":
            continue
        assert got.act_bytes_full == want.act_bytes_full, (kind, got.act_bytes_full, want.act_bytes_full)
        # selective recompute re-runs the softmax attention core (megatron-core's checkpoint keeps an int32
        # more); the Gated DeltaNet has none, so its selective bytes are its bytes
        extra = 0 if kind == "qwen3_5_linear_layer" else 4
        assert got.act_bytes_selective == want.act_bytes_selective + extra, \
            (kind, got.act_bytes_selective, want.act_bytes_selective)
