"""Qwen2.5-VL model family: planning side (presets at the published sizes, window/full ViT layer kinds and their
costs, the shape's segment sums), config.json in both forms and its refusals, and the model against transformers
on tiny random checkpoints (``hf_tiny_qwen``: two images with ragged windows, full-attention layers inside the
ViT, 3 ViT heads, mrope_section [2, 1, 1], tied and untied): logits within 1e-5 (fp32, eager) at every pipeline
cut in one process (the round trip and TP1/TP2/PP2 logits through scripts/hf_logits.py: tests/test_conformance.py)."""

import pytest

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny_qwen as q  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.shape import MicroBatchShape  # noqa: E402
from omnibal_ext.model.units import build_units, get_preset, role_summary, unit_components  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"untied"|"tied": (folder, transformers model)}."""
    return hf_check.untied_and_tied(tmp_path_factory, q.make_tiny)


# --------------------------------------------------------------------------------------------------
# planning side
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, layers, hidden, heads, groups, ffn, vocab, tied, params_b", [
    ("qwen2.5-vl-3b", 36, 2048, 16, 2, 11008, 151936, True, 3.75),
    ("qwen2.5-vl-7b", 28, 3584, 28, 4, 18944, 152064, False, 8.29),
    ("qwen2.5-vl-32b", 64, 5120, 40, 8, 27648, 152064, False, 33.45),
    ("qwen2.5-vl-72b", 80, 8192, 64, 8, 29568, 152064, False, 73.4),
])
def test_presets_are_the_published_sizes(name, layers, hidden, heads, groups, ffn, vocab, tied, params_b):
    spec = get_preset(name)
    v, lang = spec.vision, spec.language
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.ffn_hidden_size, v.window_size) == (32, 1280, 16, 3420, 112)
    assert v.fullatt_block_indexes == (7, 15, 23, 31)
    assert (lang.num_layers, lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.ffn_hidden_size,
            lang.vocab_size, lang.tie_word_embeddings) == (layers, hidden, heads, groups, ffn, vocab, tied)
    assert lang.mrope_section == (16, 24, 24) and lang.qkv_bias and lang.rotary_base == 1000000
    comps = unit_components(spec)
    total = sum(c.params(1) for c in comps) - (lang.vocab_size * hidden if tied else 0)  # HeadCost counts it
    assert abs(total / 1e9 - params_b) / params_b < 0.01
    kinds = [u.kind for u in build_units(spec) if u.code == "v"]
    assert [i for i, k in enumerate(kinds) if k == "qwen_vit_full_layer"] == [7, 15, 23, 31]
    assert role_summary(spec).startswith("I v*32 P E t*")


def test_window_and_full_layers_cost_their_segments():
    spec = get_preset("qwen2.5-vl-7b")
    comps = {c.kind: c for c in unit_components(spec)}
    window, full = comps["qwen_vit_window_layer"], comps["qwen_vit_full_layer"]
    # two images of 1024 and 2048 patches; 48 windows of 64 patches (ragged ones would add less)
    shape = MicroBatchShape(3072, 4096, vision_attn_tokens_sq=1024**2 + 2048**2, vision_window_tokens_sq=48 * 64**2)
    w = spec.vision.num_attention_heads * spec.vision.head_dim
    assert full.flops(shape, 1)[1] == 4.0 * (1024**2 + 2048**2) * w
    assert window.flops(shape, 1)[1] == 4.0 * 48 * 64**2 * w
    assert full.flops(shape, 1)[0] - full.flops(shape, 1)[1] == window.flops(shape, 1)[0] - window.flops(shape, 1)[1]
    assert full.act_bytes(shape, 1, False, "unfused").act > window.act_bytes(shape, 1, False, "unfused").act
    default = MicroBatchShape(3072, 4096)  # one image, full windows
    assert full.flops(default, 1)[1] == 4.0 * 3072**2 * w and window.flops(default, 1)[1] == 4.0 * 3072 * 64 * w
    assert MicroBatchShape.from_dict(shape.to_dict()) == shape
    assert set(default.to_dict()) == {"vision_items", "llm_tokens", "dtype_bytes", "llm_attn_tokens_sq"}
    assert comps["qwen_vit_embed"].params(1) == 1280 * 1176
    assert full.params(2) == full.params(1)  # 16 heads: no padding at TP 2


# --------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------
def flat_form(nested: dict) -> dict:
    """The published checkpoints' flat config.json of the same model."""
    t = dict(nested["text_config"])
    rope = t.pop("rope_parameters")
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    flat.update(t, model_type="qwen2_5_vl", rope_theta=rope["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    vision = dict(flat["vision_config"])
    vision["in_chans"] = vision.pop("in_channels")
    vision.pop("rope_parameters")
    flat["vision_config"] = vision
    return flat


def test_config_nested_and_flat_forms(tiny):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    for name, (folder, _) in tiny.items():
        cfg = read_config(str(folder))
        spec, info = spec_from_config(cfg)
        assert spec_from_config(flat_form(cfg))[0] == spec
        assert spec.family == "qwen2_5_vl" and info.image_token_id == q.IMAGE_ID
        assert spec.vision.fullatt_block_indexes == (1, 2) and spec.vision.window_size == 56
        assert spec.language.mrope_section == (2, 1, 1) and spec.language.tie_word_embeddings == (name == "tied")
        assert spec.language.vocab_real == q.VOCAB and spec.language.vocab_size == 384


@pytest.mark.parametrize("where, key, value", [
    ("text_config", "hidden_act", "gelu"),
    ("vision_config", "hidden_act", "gelu"),
    ("vision_config", "out_hidden_size", 48),
    ("vision_config", "fullatt_block_indexes", [9]),
    ("text_config", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}),
])
def test_unimplemented_config_is_refused_naming_the_key(tiny, where, key, value):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    cfg = read_config(str(tiny["untied"][0]))
    cfg[where][key] = value
    with pytest.raises(UserError, match=key):
        spec_from_config(cfg)


# --------------------------------------------------------------------------------------------------
# logits, conversion
# --------------------------------------------------------------------------------------------------
def test_logits_match_transformers_at_every_pipeline_cut(megatron_world, tiny):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    batch = q.inputs()
    for name, (folder, model) in tiny.items():
        src = HFSource.open(str(folder))
        want = q.hf_logits(model, batch)
        got = chained_logits(src, batch)
        assert got.shape == want.shape == (batch["input_ids"].shape[1], q.VOCAB)
        assert (got - want).abs().max() <= TOL, name
        n = len(build_units(src.spec))
        for cut in range(1, n):  # ViT split between window and full layers, tied E and L apart, ...
            assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, (name, cut)
    # the mrope ids matter: without mm_token_type_ids transformers falls back to 1-D positions, and differs
    one_d = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}
    assert (q.hf_logits(tiny["untied"][1], one_d) - want).abs().max() > 1e-3


