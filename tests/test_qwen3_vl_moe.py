"""Qwen3-VL-MoE (the Qwen3-VL family with an MoE LLM): presets at the published sizes; tiny random transformers
``Qwen3VLMoeForConditionalGeneration`` checkpoints (``hf_tiny_qwen3_vl.make_tiny_moe``: top-2 of 6 experts of width
20 beside hidden 32 (H != 2I), layer 1 of 3 dense through ``mlp_only_layers``, DeepStack into layers 0 (MoE) and 1
(dense), every parameter perturbed) with the fused experts as a 5.x save writes them ([E, 2I, H], [E, H, I]) and
transposed as the published files hold them: logits within 1e-5 of transformers (fp32, eager) at every pipeline cut
in one process, import -> export bit-identical in the layout read and loaded by transformers; EP2, TP2, PP2 and
EP2 x TP2 through ``scripts/hf_logits.py`` under torchrun (slow)."""
import json

import pytest

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny_qwen3_vl as tiny_vl  # noqa: E402
from test_internvl3_5_moe import PARALLEL  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.units import build_units, get_preset, unit_components  # noqa: E402

TOL = 1e-5
LAYOUTS = {"saved": False, "published": True}  # make_tiny_moe's ``published``

# --------------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------------
# Published facts of Qwen/Qwen3-VL-30B-A3B-Instruct and -235B-A22B-Instruct (Megatron model scripts for them, as in
# slime / Megatron-Bridge: layers, hidden, ffn_hidden_size, heads, KV groups 4, kv_channels 128, rope 5e6, vocab
# 151936, moe_ffn_hidden_size 768 / 1536, top 8 of 128 experts, untied); the ViT is Qwen3-VL's large one (27 layers,
# 1152 wide, 16 heads, MLP 4304, DeepStack at 8, 16, 24, as Qwen3-VL-8B / -32B). Totals: the Hugging Face model
# pages (31.1B and 236B parameters).
LARGE_VIT = (27, 1152, 16, 4304, (8, 16, 24))
PUBLISHED = {  # (layers, hidden, heads, kv, head_dim, ffn, vocab), (experts, topk, expert ffn), total (B, 1 digit)
    "qwen3-vl-30b-a3b": ((48, 2048, 32, 4, 128, 6144, 151936), (128, 8, 768), 31.1),
    "qwen3-vl-235b-a22b": ((94, 4096, 64, 4, 128, 12288, 151936), (128, 8, 1536), 235.7),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_sizes(name):
    llm, experts, total_b = PUBLISHED[name]
    spec = get_preset(name)
    v, lang, moe = spec.vision, spec.language, spec.language.moe
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.ffn_hidden_size, v.deepstack_visual_indexes) == \
        LARGE_VIT
    assert (lang.num_layers, lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.kv_channels,
            lang.ffn_hidden_size, lang.vocab_size) == llm
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size) == experts
    assert moe.layer_freq == (1,) * lang.num_layers and moe.norm_topk_prob and not moe.shared_expert_ffn_hidden_size
    assert (lang.rotary_base, lang.mrope_section, lang.mrope_interleaved, lang.tie_word_embeddings) == \
        (5000000, (24, 20, 20), True, False)
    assert round(sum(c.params(1) for c in unit_components(spec)) / 1e9, 1) == total_b


# --------------------------------------------------------------------------------------------------
# tiny checkpoints
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{layout: (folder, transformers model (eager))}: the same weights in both layouts."""
    out = {}
    for name, published in LAYOUTS.items():
        folder = tmp_path_factory.mktemp(f"qwen3-vl-moe-{name}")
        out[name] = (folder, tiny_vl.make_tiny_moe(folder, seed=7, published=published))
    return out


def test_spec_and_the_expert_layout_of_each_checkpoint(tiny):
    from safetensors import safe_open

    from megatron.vlm.hf.convert import HFSource

    for name, (folder, _) in tiny.items():
        src = HFSource.open(str(folder))
        moe = src.spec.language.moe
        assert (src.spec.family, src.info.text_family) == ("qwen3_vl", "qwen3_vl_moe")
        assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.layer_freq, moe.norm_topk_prob) == \
            (6, 2, 20, (1, 0, 1), True)
        assert src.spec.language.kv_channels == 16 and not src.spec.language.tie_word_embeddings
        assert src.info.transposed == (("gate_up_proj", "down_proj") if LAYOUTS[name] else ())
        with safe_open(str(folder / "model.safetensors"), "pt") as f:  # the layouts are the ones named
            shape = tuple(f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape())
        assert shape == ((6, 32, 40) if LAYOUTS[name] else (6, 40, 32))


def test_config_cases(tiny):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    cfg = read_config(str(tiny["saved"][0]))
    for key, value, match in (("norm_topk_prob", False, "norm_topk_prob"),
                              ("shared_expert_intermediate_size", 8, "shared_expert_intermediate_size")):
        bad = json.loads(json.dumps(cfg))
        bad["text_config"][key] = value
        with pytest.raises(UserError, match=match):
            spec_from_config(bad)
    # Qwen3VLMoeTextConfig's head_dim default: hidden / heads (Qwen3's own is 128)
    no_head_dim = json.loads(json.dumps(cfg))
    del no_head_dim["text_config"]["head_dim"]
    no_head_dim["text_config"]["rope_parameters"]["mrope_section"] = [2, 1, 1]  # 8 / 2 rotary pairs
    assert spec_from_config(no_head_dim)[0].language.kv_channels == 32 // 4
    # the text config's own tie_word_embeddings (its class default True) does not tie: the top-level one does
    assert cfg["text_config"].get("tie_word_embeddings", True)
    assert not spec_from_config(cfg)[0].language.tie_word_embeddings


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers_at_every_pipeline_cut(megatron_world, tiny, layout):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    folder, model = tiny[layout]
    batch = tiny_vl.inputs()
    want = tiny_vl.hf_logits(model, batch)
    src = HFSource.open(str(folder))
    n = len(build_units(src.spec))
    for cut in range(1, n):
        assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, cut
    got = chained_logits(src, batch)
    assert got.shape == want.shape and (got - want).abs().max() <= TOL


def test_import_export_round_trip_in_the_layout_read_and_transformers_loads_it(megatron_world, tiny, tmp_path):
    pairs = hf_check.assert_round_trips({name: folder for name, (folder, _) in tiny.items()}, tmp_path)
    hf_check.assert_transformers_loads_the_same("Qwen3VLMoeForConditionalGeneration", pairs, tiny_vl.inputs(), tmp_path)


@pytest.mark.slow
def test_hf_logits_script_under_torchrun(tiny, tmp_path):
    """Every PARALLEL layout (PP 2: the default two-stage layout): one launch of 2 ranks, one of 4."""
    layouts = {name: (nproc, ["--pipeline-model-parallel-size", "2"] if name.startswith("pp2") else flags)
               for name, (nproc, flags) in PARALLEL.items()}
    folder, model = tiny["published"]
    batch = tiny_vl.inputs()
    want = tiny_vl.hf_logits(model, batch)
    for parallel, got in hf_check.logits_by_layout(folder, batch, tmp_path, layouts).items():
        assert (got - want).abs().max() <= TOL, parallel
