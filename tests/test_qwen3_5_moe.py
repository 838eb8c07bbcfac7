"""Qwen3.5-MoE (the Qwen3.5 family with MoE layers, transformers' ``qwen3_5_moe``): presets at the published sizes;
tiny random transformers ``Qwen3_5MoeForConditionalGeneration`` checkpoints (``hf_tiny_qwen3_5_moe``: top 2 of 6
experts of width 20 beside hidden 32 (H != 2I), a gated shared expert, LLM layers linear, full, full, linear,
linear, partial rotary, linear heads unlike the attention heads, every parameter perturbed, rms_norm_eps 1e-3: the
gated norm's fp32 conditioning, ``hf_tiny_qwen3_5.make_tiny``, puts eps 1e-5 at 1.3e-5) with the experts one
tensor each (what a 5.23 ``save_pretrained`` writes) and stacked (``gate_up_proj`` / ``down_proj``, what the
published files hold): logits within 1e-5 of transformers (fp32, eager) at every pipeline cut in one process,
import -> export bit-identical in the layout read and loaded by transformers; TP1, TP2 + SP, PP2 between a linear and a
full-attention layer and EP2 through ``scripts/hf_logits.py`` under torchrun, and EP2 training as the serial run
within 1e-4 (slow)."""
import json

import pytest

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny_qwen3_5_moe as tiny_moe  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.units import build_units, get_preset, unit_components  # noqa: E402

TOL = 1e-5
LAYOUTS = {"saved": False, "published": True}  # make_tiny_moe's ``published``

# --------------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------------
# Published facts. Qwen/Qwen3.5-35B-A3B: slime's scripts/models/qwen3.5-35B-A3B.sh (40 layers, hidden 2048, 16 heads
# in 2 KV groups of 256, 256 experts top 8 of width 512, shared expert 512 with its gate, linear 16 key / 32 value
# heads of 128, vocab 248320, rope 1e7, rotary 0.25, untied), the same numbers as transformers'
# Qwen3_5MoeTextConfig defaults. Qwen/Qwen3.5-397B-A17B: NVIDIA Megatron-LM's MIMO example config for it ("all
# values match the HuggingFace text_config": 60 layers, hidden 4096, 32 heads in 2 KV groups of 256, 512 experts
# top 10 of width 1024, shared expert 1024 with its gate, linear 16 key / 64 value heads of 128, untied) and
# slime's scripts/models/qwen3.5-397B-A17B.sh (the same). Qwen/Qwen3.5-122B-A10B: a model page's specification
# (48 layers, hidden 3072, 32 heads in 2 KV groups of 256, rope 1e7, 256 experts of width 1024, 9 active, the dense
# FFN width 1024, vocab 248320), quantized copies' cards (8 routed + 1 shared expert, 36 linear + 12 full layers
# 3:1, a 27-block ViT 1152 wide) and a GGUF's parameter count, 122.11B (the LLM: embedding, layers, head): the
# linear heads (16 key / 64 value) and the shared expert's width (1024) are the ones that count gives
# (test_122b_a10b_llm_is_the_published_parameter_count; 16 / 32 heads would give 120.75B, a 512 shared expert
# 121.89B). The ViT: transformers' Qwen3_5MoeVisionConfig defaults (27 layers, 1152 wide, 16 heads, MLP 4304).
# Totals: the model names (35B, 397B); 122B-A10B's with its ViT is 122.56B (its LLM alone the published 122.11B).
LARGE_VIT = (27, 1152, 16, 4304, ())
PUBLISHED = {  # (layers, hidden, heads, kv, head_dim, vocab), (experts, topk, expert ffn, shared ffn),
    # (linear key heads, value heads), total (B)
    "qwen3.5-35b-a3b": ((40, 2048, 16, 2, 256, 248320), (256, 8, 512, 512), (16, 32), 35),
    "qwen3.5-122b-a10b": ((48, 3072, 32, 2, 256, 248320), (256, 8, 1024, 1024), (16, 64), 123),
    "qwen3.5-397b-a17b": ((60, 4096, 32, 2, 256, 248320), (512, 10, 1024, 1024), (16, 64), 397),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_sizes(name):
    llm, experts, linear, total_b = PUBLISHED[name]
    spec = get_preset(name)
    v, lang, moe = spec.vision, spec.language, spec.language.moe
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.ffn_hidden_size, v.deepstack_visual_indexes) == \
        LARGE_VIT
    assert (lang.num_layers, lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.kv_channels,
            lang.vocab_size) == llm
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.shared_expert_ffn_hidden_size) == experts
    assert (lang.linear_num_key_heads, lang.linear_num_value_heads) == linear
    assert moe.layer_freq == (1,) * lang.num_layers and moe.norm_topk_prob and moe.shared_expert_gate
    assert (lang.rotary_base, lang.mrope_section, lang.partial_rotary_factor, lang.tie_word_embeddings) == \
        (10000000, (11, 11, 10), 0.25, False)
    assert lang.layer_types.count("full_attention") == lang.num_layers // 4
    assert round(sum(c.params(1) for c in unit_components(spec)) / 1e9) == total_b


def test_122b_a10b_llm_is_the_published_parameter_count():
    """The 122B-A10B LLM (embedding, 48 layers, head; no ViT, no MTP layer) holds 122.11B parameters, the count its
    GGUF conversion publishes: the check that fixes the preset's linear heads and shared expert width."""
    spec = get_preset("qwen3.5-122b-a10b")
    llm = sum(c.params(1) for u, c in zip(build_units(spec), unit_components(spec)) if u.code in "EtL")
    assert round(llm / 1e7) == 12211


# --------------------------------------------------------------------------------------------------
# tiny checkpoints
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{layout: (folder, transformers model (eager))}: the same weights in both layouts."""
    out = {}
    for name, published in LAYOUTS.items():
        folder = tmp_path_factory.mktemp(f"qwen3-5-moe-{name}")
        out[name] = (folder, tiny_moe.make_tiny_moe(folder, seed=7, published=published, eps=1e-3))
    return out


def test_spec_and_the_expert_layout_of_each_checkpoint(tiny):
    from megatron.vlm.hf.convert import HFSource

    for name, (folder, _) in tiny.items():
        src = HFSource.open(str(folder))
        lang, moe = src.spec.language, src.spec.language.moe
        assert src.spec.family == "qwen3_5"
        assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.shared_expert_ffn_hidden_size) == (6, 2, 20, 12)
        assert moe.layer_freq == (1,) * 5 and moe.norm_topk_prob and moe.shared_expert_gate
        assert lang.layer_types == tiny_moe.LAYER_TYPES and lang.rotary_dim == 4
        assert src.info.fused_experts == LAYOUTS[name] and src.info.transposed == ()
        kinds = [u.kind for u in build_units(src.spec) if u.code == "t"]
        assert kinds == ["qwen3_5_linear_moe_layer", "qwen3_5_attention_moe_layer", "qwen3_5_attention_moe_layer",
                         "qwen3_5_linear_moe_layer", "qwen3_5_linear_moe_layer"]


@pytest.mark.parametrize("key, value", [("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                                        ("norm_topk_prob", False), ("shared_expert_intermediate_size", 0)])
def test_unimplemented_moe_config_is_refused_naming_the_key(tiny, key, value):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    bad = read_config(str(tiny["saved"][0]))
    bad["text_config"][key] = value
    with pytest.raises(UserError, match=key):
        spec_from_config(bad)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers_at_every_pipeline_cut(megatron_world, tiny, layout):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    folder, model = tiny[layout]
    batch = tiny_moe.inputs()
    want = tiny_moe.hf_logits(model, batch)
    src = HFSource.open(str(folder))
    got = chained_logits(src, batch)
    assert got.shape == want.shape and (got - want).abs().max() <= TOL
    if layout == "saved":  # the cuts: once
        for cut in range(1, len(build_units(src.spec))):
            assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, cut


def test_stacked_experts_written_transposed_are_read_by_their_shapes(megatron_world, tiny, tmp_path):
    """The stacked experts as Qwen3-VL-MoE's published files hold them ([E, H, 2I], [E, I, H]): read by their
    shapes (``HFInfo.transposed``), the logits unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    folder, model = tiny["published"]
    shutil.copytree(folder, tmp_path / "t")
    tensors = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
               for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(tmp_path / "t" / "model.safetensors"), metadata={"format": "pt"})
    src = HFSource.open(str(tmp_path / "t"))
    assert src.info.fused_experts and src.info.transposed == ("gate_up_proj", "down_proj")
    batch = tiny_moe.inputs()
    assert (chained_logits(src, batch) - tiny_moe.hf_logits(model, batch)).abs().max() <= TOL


def test_import_export_round_trip_in_the_layout_read_and_transformers_loads_it(megatron_world, tiny, tmp_path):
    pairs = hf_check.assert_round_trips({name: folder for name, (folder, _) in tiny.items()}, tmp_path)
    hf_check.assert_transformers_loads_the_same("Qwen3_5MoeForConditionalGeneration", pairs, tiny_moe.inputs(),
                                                tmp_path)


# --------------------------------------------------------------------------------------------------
# TP1 / TP2 + SP / PP2 / EP2 under torchrun
# --------------------------------------------------------------------------------------------------
PARALLEL = {"tp1": (1, []),
            "tp2-sp": (2, ["--tensor-model-parallel-size", "2"]),  # ETP = TP = 2, sequence-parallel MoE layers
            # the boundary after LLM layer 0: a linear layer | a full-attention one
            "pp2-linear-full-cut": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2PEt|t*4L"]),
            "ep2": (2, ["--expert-model-parallel-size", "2"])}


@pytest.mark.slow
def test_hf_logits_script_under_torchrun(tiny, tmp_path):
    """Every PARALLEL layout: one launch of 1 rank, one of 2."""
    folder, model = tiny["published"]
    batch = tiny_moe.inputs()
    want = tiny_moe.hf_logits(model, batch)
    for parallel, got in hf_check.logits_by_layout(folder, batch, tmp_path, PARALLEL).items():
        assert (got - want).abs().max() <= TOL, parallel


# --------------------------------------------------------------------------------------------------
# training: EP2 as the serial run
# --------------------------------------------------------------------------------------------------
TRAIN_TOL = 1e-4  # relative, on each iteration's loss and gradient norm
RUN = ["--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "5e-4",
       "--lr-warmup-iters", "0", "--seed", "5", "--moe-aux-loss-coeff", "0.01"]


@pytest.mark.slow
def test_ep2_trains_as_the_serial_run(tmp_path_factory, data_cache, serial_run, tmp_path):
    pytest.importorskip("tokenizers")
    from launch import run_training

    folder = tmp_path_factory.mktemp("qwen3_5_moe_training")
    flags = tiny_moe.training_flags(folder, data_cache, seed=3, eps=1e-3) + RUN
    serial = serial_run(flags)
    got, out = run_training(2, flags + ["--expert-model-parallel-size", "2"], tmp_path, "ep2")
    assert "loaded weights from --hf-checkpoint" in out
    assert [r["iteration"] for r in got] == [r["iteration"] for r in serial] == [1, 2, 3]
    for g, w in zip(got, serial):
        for key in ("lm loss", "grad norm"):
            assert abs(g[key] - w[key]) <= TRAIN_TOL * abs(w[key]), (key, g, w)


def test_moe_units_cost_their_mixer_and_the_routed_tokens_in_closed_form():
    """A layer's forward FLOPs: its token mixer (the dense kind's, whose SwiGLU MLP of the shared width the closed
    form takes out) plus the router ``2 T H E``, the routed experts ``6 T k H I``, the shared expert ``6 T H Is``
    and its gate ``2 T H``; parameters likewise; every layer's unit is its kind's MoE one."""
    import dataclasses

    from megatron.vlm.families.qwen3_5.kinds import (ATTENTION_LAYER, ATTENTION_MOE_LAYER, LINEAR_LAYER,
                                                     LINEAR_MOE_LAYER)
    from omnibal_ext.model.moe import ExpertGrid
    from omnibal_ext.model.moe_cost import ExpertRun
    from omnibal_ext.model.shape import MicroBatchShape

    spec = get_preset("qwen3.5-35b-a3b")
    lang, moe = spec.language, spec.language.moe
    dense = spec.replace(language=dataclasses.replace(lang, moe=None))
    T, H, E, k, F, Fs = 4096, lang.hidden_size, moe.num_experts, moe.topk, moe.ffn_hidden_size, \
        moe.shared_expert_ffn_hidden_size
    shape = MicroBatchShape(vision_items=64, llm_tokens=T, llm_attn_tokens_sq=4 * 1024.0 ** 2)
    mlp_flops = 2 * T * H * E + 6 * T * k * H * F + 6 * T * H * Fs + 2 * T * H
    mlp_params = E * H + 3 * E * H * F + 3 * H * Fs + H
    for moe_kind, dense_kind in ((LINEAR_MOE_LAYER, LINEAR_LAYER), (ATTENTION_MOE_LAYER, ATTENTION_LAYER)):
        moe_cost, dense_cost = moe_kind.cost_of(spec), dense_kind.cost_of(dense)
        mixer = dense_cost.flops(shape, 1)[0] - 6 * T * H * Fs
        assert moe_cost.flops(shape, 1)[0] == pytest.approx(mixer + mlp_flops, rel=1e-12)
        assert moe_cost.params(1) == dense_cost.params(1) - 3 * H * Fs + mlp_params
        assert moe_cost.expert_params() == 3 * E * H * F
        run = ExpertRun(ExpertGrid(ep=8), imbalance=1.5)  # the planner's EP search keeps the kind
        priced = moe_cost.with_experts(run)
        assert type(priced) is moe_kind.cost and priced.run == run and priced.kind == moe_kind.name
    kinds = {u.kind for u in build_units(spec) if u.code == "t"}
    assert kinds == {"qwen3_5_linear_moe_layer", "qwen3_5_attention_moe_layer"}
