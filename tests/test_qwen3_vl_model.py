"""Qwen3-VL model family (dense): planning side (presets at the published sizes, DeepStack layers and their side
tensors), config.json in the transformers 5 and 4.x forms and its refusals, and the model against transformers on
tiny random checkpoints (``hf_tiny_qwen3_vl``: every parameter perturbed, DeepStack at the first and last ViT
layer, interleaved mrope_section [2, 3, 3], a 3 x 3 position grid smaller than the images, 3 ViT heads, tied and
untied): logits within 1e-5 (fp32, eager) at the pipeline cuts no DeepStack feature crosses in one process; a
model that drops DeepStack or builds chunked mrope is off by at least 1000x that; the DeepStack mergers follow the
projector's freezing (the round trip and TP1/TP2/PP2 logits through scripts/hf_logits.py: tests/test_conformance.py)."""
import dataclasses
import json

import pytest
import torch

from megatron.vlm.lineages.qwen.qwen3_vit.batch import Qwen3Vision
from megatron.vlm.stage.micro_batch import MicroBatch

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny_qwen3_vl as q  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.units import build_units, family_of, get_preset, role_summary, unit_components  # noqa: E402

TOL = 1e-5

# The published config.json facts of Qwen/Qwen3-VL-*-Instruct, and where each was read (public copies quoted in
# repositories, found with the project's code search; the Hub is not reachable from here):
# * 4B: the whole config.json quoted in a test of a Qwen3-VL port (transformers_version 4.57.0.dev0): text 36 layers,
#   hidden 2560, 32 / 8 heads, head_dim 128, intermediate 9728, vocab 151936, rope_theta 5e6, rope_scaling
#   {mrope_interleaved: true, mrope_section: [24, 20, 20]}, tie_word_embeddings true; vision depth 24, hidden 1024,
#   16 heads, intermediate 4096, num_position_embeddings 2304, deepstack_visual_indexes [5, 11, 17], out 2560;
# * 2B: "Qwen/Qwen3-VL-2B-Instruct at 89644892e4d8" quoted in a serving project's test: text 28 layers, hidden 2048,
#   16 / 8 heads, head_dim 128, intermediate 6144, rope_theta 5e6; vision hidden 1024, deepstack [5, 11, 17], out
#   2048 (depth 24 / intermediate 4096 / tie true from an engine's defaults "aligned with config.json");
# * 8B: a blog's partial copy of Qwen3-VL-8B-Instruct's config.json: text hidden 4096, 36 layers, 32 / 8 heads,
#   mrope_interleaved, [24, 20, 20], rope_theta 5e6; vision depth 27, hidden 1152, out 4096, deepstack [8, 16, 24];
#   an app's "published vision shape": 16 heads, intermediate 4304; intermediate 12288 and untied: its LLM Qwen3-8B;
#   LM Studio's model card: 8.77B parameters;
# * 32B: a checker of a Qwen3-VL-32B-based text encoder: text 64 layers, hidden 5120, 64 / 8 heads, head_dim 128,
#   intermediate 25600; vision depth 27, hidden 1152, intermediate 4304, 16 heads, out 5120; deepstack [8, 16, 24]
#   and rope_theta 5e6 from a port's defaults for it; untied as its LLM Qwen3-32B.
PUBLISHED = {  # name: (ViT depth, hidden, heads, ffn, deepstack, LLM layers, hidden, heads, kv, ffn, tied)
    "qwen3-vl-2b": (24, 1024, 16, 4096, (5, 11, 17), 28, 2048, 16, 8, 6144, True),
    "qwen3-vl-4b": (24, 1024, 16, 4096, (5, 11, 17), 36, 2560, 32, 8, 9728, True),
    "qwen3-vl-8b": (27, 1152, 16, 4304, (8, 16, 24), 36, 4096, 32, 8, 12288, False),
    "qwen3-vl-32b": (27, 1152, 16, 4304, (8, 16, 24), 64, 5120, 64, 8, 25600, False),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"untied"|"tied": (folder, transformers model)}."""
    return hf_check.untied_and_tied(tmp_path_factory, q.make_tiny)


# --------------------------------------------------------------------------------------------------
# planning side
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_sizes(name):
    depth, vh, vheads, vffn, ds, layers, hidden, heads, kv, ffn, tied = PUBLISHED[name]
    spec = get_preset(name)
    v, lang = spec.vision, spec.language
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.ffn_hidden_size, v.deepstack_visual_indexes) == \
        (depth, vh, vheads, vffn, ds)
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size, v.num_position_embeddings) == (16, 2, 2, 2304)
    assert (lang.num_layers, lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.ffn_hidden_size,
            lang.tie_word_embeddings) == (layers, hidden, heads, kv, ffn, tied)
    assert (lang.kv_channels, lang.vocab_size, lang.rotary_base, lang.mrope_section) == (128, 151936, 5000000,
                                                                                        (24, 20, 20))
    assert lang.mrope_interleaved and lang.qk_norm and not lang.qkv_bias
    assert role_summary(spec).startswith(f"I v*{depth} P E t*{layers} L")
    kinds = [u.kind for u in build_units(spec) if u.code == "v"]
    assert [i for i, k in enumerate(kinds) if k == "qwen3_vit_deepstack_layer"] == list(ds)


def test_8b_has_the_published_parameter_count():
    spec = get_preset("qwen3-vl-8b")
    total = sum(c.params(1) for c in unit_components(spec))
    lang = spec.language
    total += lang.num_layers * 2 * lang.kv_channels  # q/k norms (not in the shared layer's count)
    assert abs(total / 1e9 - 8.77) < 0.01


def test_side_tensors_are_the_deepstack_features():
    spec = get_preset("qwen3-vl-tiny")  # DeepStack at ViT layers 0 and 3
    units = build_units(spec)
    sides = family_of(spec).side_tensors(spec)
    assert [(s.name, units[s.producer].name, [units[c].name for c in s.consumers], s.width) for s in sides] == [
        ("deepstack.0", "vit.layer.0", ["llm.layer.0"], 64), ("deepstack.1", "vit.layer.3", ["llm.layer.1"], 64)]
    comps = {u.name: c for u, c in zip(units, unit_components(spec))}
    plain, ds = comps["vit.layer.1"], comps["vit.layer.0"]
    merger = comps["projector"]
    # a DeepStack layer = a layer + a merger of the projector's size, but with its norm over 4 x hidden
    assert ds.params(1) - plain.params(1) == merger.params(1) + 2 * 3 * 48
    from omnibal_ext.model.shape import MicroBatchShape

    shape = MicroBatchShape(240, 400, vision_attn_tokens_sq=60**2 * 4)
    assert ds.flops(shape, 1)[0] - plain.flops(shape, 1)[0] == pytest.approx(merger.flops(shape, 1)[0])
    assert plain.flops(shape, 1)[1] == 4.0 * 60**2 * 4 * 48


# --------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------
def v4_form(v5: dict) -> dict:
    """The transformers 4.x config.json of the same model: rope_scaling with the sections, rope_theta beside it."""
    cfg = json.loads(json.dumps(v5))
    t = cfg["text_config"]
    rope = t.pop("rope_parameters")
    t["rope_theta"] = rope.pop("rope_theta")
    t["rope_scaling"] = rope
    cfg["vision_config"].pop("rope_parameters")
    cfg["vision_config"]["model_type"] = "qwen3_vl"
    return cfg


def test_config_both_forms(tiny):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    for name, (folder, _) in tiny.items():
        cfg = read_config(str(folder))
        spec, info = spec_from_config(cfg)
        assert spec_from_config(v4_form(cfg))[0] == spec
        assert spec.family == "qwen3_vl" and info.image_token_id == q.IMAGE_ID
        v, lang = spec.vision, spec.language
        assert (v.deepstack_visual_indexes, v.num_position_embeddings, v.num_attention_heads) == ((0, 3), 9, 3)
        assert lang.mrope_section == (2, 3, 3) and lang.mrope_interleaved and lang.qk_norm and lang.kv_channels == 16
        assert lang.tie_word_embeddings == (name == "tied") and lang.vocab_real == q.VOCAB


@pytest.mark.parametrize("where, key, value", [
    ("text_config", "hidden_act", "gelu"),
    ("text_config", "attention_bias", True),
    ("vision_config", "hidden_act", "silu"),
    ("vision_config", "out_hidden_size", 48),
    ("vision_config", "deepstack_visual_indexes", [0, 9]),
    ("vision_config", "deepstack_visual_indexes", [0, 1, 2, 3]),  # 4 features, 3 LLM layers
    ("vision_config", "num_position_embeddings", 10),
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
def _free_cuts(spec):
    """Pipeline cuts (unit indices) that no DeepStack feature crosses."""
    sides = family_of(spec).side_tensors(spec)
    n = len(build_units(spec))
    return [c for c in range(1, n) if not any(s.producer < c <= s.last_consumer for s in sides)]


def test_logits_match_transformers(megatron_world, tiny):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    batch = q.inputs()
    for name, (folder, model) in tiny.items():
        src = HFSource.open(str(folder))
        want = q.hf_logits(model, batch)
        got = chained_logits(src, batch)
        assert got.shape == want.shape == (batch["input_ids"].shape[1], q.VOCAB)
        assert (got - want).abs().max() <= TOL, name
        cuts = _free_cuts(src.spec)
        assert cuts == [1, 9, 10]  # I | ..., inside the LLM past the DeepStack layers, ... | L
        for cut in cuts:
            assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, (name, cut)


def test_dropping_deepstack_or_chunked_mrope_is_caught(megatron_world, tiny):
    """A model without the DeepStack features (transformers' own, its indexes emptied) and ours with chunked mrope
    sections are both off by at least 1000x the tolerance."""
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    batch = q.inputs()
    folder, model = tiny["untied"]
    want = q.hf_logits(model, batch)
    visual = model.model.visual
    kept = visual.deepstack_visual_indexes
    visual.deepstack_visual_indexes = []
    try:
        dropped = q.hf_logits(model, batch)
    finally:
        visual.deepstack_visual_indexes = kept
    assert (dropped - want).abs().max() >= 1000 * TOL
    src = HFSource.open(str(folder))
    chunked = dataclasses.replace(src, spec=src.spec.replace(
        language=dataclasses.replace(src.spec.language, mrope_interleaved=False)))
    assert (chained_logits(chunked, batch) - want).abs().max() >= 1000 * TOL


# --------------------------------------------------------------------------------------------------
# freezing: the DeepStack mergers are the projector's
# --------------------------------------------------------------------------------------------------
def _stage(trains):
    from megatron.vlm.stage.build import StageBuild, build_stage

    spec = get_preset("qwen3-vl-tiny")
    return build_stage(StageBuild(spec, range(len(build_units(spec))), trainable=trains))


@pytest.mark.parametrize("flags", [dict(vit=True), dict(projector=True), dict(vit=True, llm=True)])
def test_deepstack_mergers_follow_the_projector(megatron_world, flags):
    from omnibal_ext.model.trainable import Freeze

    spec = get_preset("qwen3-vl-tiny")
    units = build_units(spec)
    t = Freeze(**flags).trainable(units, spec=spec)
    stage = _stage(t.trains)
    projector_trains = not flags.get("projector", False)
    seen = set()
    for unit, module, _ in stage.unit_modules():
        for name, p in module.named_parameters():
            if name.startswith("deepstack_merger."):
                seen.add(unit.name)
                assert p.vlm_role == "P" and p.requires_grad == projector_trains, (unit.name, name)
            else:
                assert p.vlm_role == unit.code and p.requires_grad == t.trains[unit.index], (unit.name, name)
    assert seen == {"vit.layer.0", "vit.layer.3"}
    # planning: a frozen ViT's DeepStack units hold trained merger parameters (optimizer state, gradients)
    merger_params = sum(p.numel() for n, p in stage.named_parameters() if "deepstack_merger." in n) // 2
    for u in units:
        trained = t.adapters[u.index][0] if t.adapters else 0
        is_ds = u.kind == "qwen3_vit_deepstack_layer"
        assert trained == (merger_params if is_ds and flags.get("vit") and projector_trains else 0), u.name
    # the merger of a frozen ViT's first layer still gets a gradient: that unit runs with autograd
    if flags.get("vit") and projector_trains:
        assert t.frozen_prefix == 1 and stage.no_grad_parts == 1


def test_frozen_vit_trains_the_deepstack_mergers(megatron_world):
    """One backward on a tiny micro-batch with --freeze-vit: the mergers (and the projector) get gradients, the ViT
    layers none."""
    from megatron.vlm.lineages.qwen.qwen3_vit.batch import vision_fields
    from megatron.vlm.lineages.qwen.positions import mrope_position_ids
    from omnibal_ext.model.trainable import Freeze
    import numpy as np

    spec = get_preset("qwen3-vl-tiny")
    t = Freeze(vit=True).trainable(build_units(spec), spec=spec)
    stage = _stage(t.trains)
    image_id = 0
    grids = [(1, 4, 6)]
    ids = torch.tensor([5, 6, *([image_id] * 6), 7, 8])
    s = ids.numel()
    pos, _ = mrope_position_ids(ids.numpy(), grids, image_id, 2)
    batch = {"tokens": ids.reshape(1, s), "labels": torch.arange(1, s + 1).reshape(1, s) % 50,
             "mrope_position_ids": torch.from_numpy(pos).reshape(3, 1, s), "cu_seqlens": torch.tensor([0, s], dtype=torch.int32),
             "max_seqlen": s, "segment_ids": torch.zeros(1, s, dtype=torch.int64), "position_ids": torch.arange(s)[None],
             "pixel_values": torch.randn(24, spec.vision.patch_dim), **vision_fields(np.array(grids), spec)}
    stage.set_input_tensor(None)
    stage(MicroBatch.of(batch, Qwen3Vision)).loss.sum().backward()
    for name, p in stage.named_parameters():
        if "deepstack_merger." in name or name.startswith("projector."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        elif name.startswith(("vit_blocks.", "vit_embed.")):
            assert not p.requires_grad and p.grad is None, name


