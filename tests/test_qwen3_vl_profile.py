"""The trainer's profiler on Qwen3-VL (world of one): a copy of the model of few layers that keeps a DeepStack
layer, a plain ViT layer and the DeepStack index among them (``Family.few_layers``), each unit run alone many times
(the DeepStack layer's feature into a scratch cache, the text layer adding a zero feature); every unit priced, and
the bytes against the memory model: sent bytes, the kept activations of the patch embedding, the merger and both
ViT layer kinds in every recompute mode (a DeepStack merger runs outside its layer's recompute)."""
import pytest
import torch

from megatron.training.flags import build_parser
from megatron.training.specs import run_config
from omnibal_ext.model.cost_model import DEVICES, MicroBatchShape, analytic_costs
from omnibal_ext.model.families import family_of
from omnibal_ext.model.units import build_units, get_preset

SPEC = get_preset("qwen3-vl-tiny")  # DeepStack at ViT layers 0 and 3 of 4


def test_few_layers_keep_the_deepstack_indexes_they_hold():
    few = family_of(SPEC).few_layers(SPEC, 2, 1)
    assert few.vision.num_layers == 2 and few.vision.deepstack_visual_indexes == (0,)
    assert few.language.num_layers == 1
    both = family_of(SPEC).few_layers(SPEC, 4, 1)  # two features need two LLM layers
    assert both.vision.deepstack_visual_indexes == (0, 3) and both.language.num_layers == 2


def test_profile_prices_qwen3_units_as_the_memory_model(megatron_world):
    from megatron.training.profiling import profile_units

    shape = MicroBatchShape(vision_items=96, llm_tokens=120, dtype_bytes=4, vision_attn_tokens_sq=96.0 ** 2)
    args = build_parser().parse_args(["--seed", "1"])
    costs = profile_units(run_config(args, 1), SPEC, shape, 250, torch.device("cpu"), warmup=0, repeats=1)
    assert [u.name for u in costs.units] == [u.name for u in build_units(SPEC)]
    assert all(u.fwd_s > 0 and u.bwd_s > 0 for u in costs.units)
    model = {u.kind: u for u in analytic_costs(SPEC, shape, 1, DEVICES["cpu"], attention="flash").units}
    layers = ("qwen3_vit_layer", "qwen3_vit_deepstack_layer")
    for got in costs.units:
        kind, want = got.kind, model[got.kind]
        if kind != "llm_head":  # the head sends nothing on; its profile counts the per-token loss
            assert got.send_bytes == want.send_bytes, (kind, got.send_bytes, want.send_bytes)
        if kind in ("qwen3_vit_embed", "qwen3_merger") + layers:
            assert got.act_bytes == pytest.approx(want.act_bytes, rel=1e-12), (kind, got.act_bytes, want.act_bytes)
        if kind in layers:
            assert got.act_bytes_full == want.act_bytes_full, (kind, got.act_bytes_full, want.act_bytes_full)
            assert got.act_bytes_selective == pytest.approx(want.act_bytes_selective + 4, rel=1e-12), \
                (kind, got.act_bytes_selective, want.act_bytes_selective)
