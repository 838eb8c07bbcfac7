"""Qwen3.5 model family (dense): planning side (presets at the published sizes, the two LLM layer kinds), config.json
and its refusals, and the model against transformers on tiny random checkpoints (``hf_tiny_qwen3_5``: every
parameter perturbed, layers linear/full/full/linear/linear, partial rotary, linear heads unlike the attention
heads, tied and untied): logits within 1e-5 (fp32, eager, transformers' torch delta rule) at every pipeline cut in
one process; dropping the output gate or the zero-centring is caught (the round trip and TP1/TP2/PP2 logits through scripts/hf_logits.py: tests/test_conformance.py)."""
import dataclasses
import json

import pytest
import torch

from megatron.vlm.lineages.qwen.qwen3_vit.batch import Qwen3Vision
from megatron.vlm.stage.micro_batch import MicroBatch

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny_qwen3_5 as q  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.units import build_units, get_preset, role_summary  # noqa: E402

TOL = 1e-5


# The published config.json facts of the dense Qwen/Qwen3.5 folders, and where each was read (public copies found
# with the project's code and page search; the Hub is not reachable from here):
# * 0.8B: "a compact mirror of Qwen/Qwen3.5-0.8B's config.json" in a C++ port's test: text 24 layers, hidden 1024,
#   intermediate 3584, 8 / 2 heads, head_dim 256, linear 16 key / 16 value heads of 128, conv kernel 4, layer_types
#   [L, L, L, F] x 6, mrope_section [11, 11, 10], vocab 248320, tie_word_embeddings true; an engine's test of the same
#   config: vision depth 12, hidden 768, rope_theta 1e7, partial_rotary_factor 0.25, mrope_interleaved; slime's
#   scripts/models/qwen3.5-0.8B.sh the same LLM (--rotary-percent 0.25, --rotary-base 10000000, --apply-layernorm-1p,
#   --attention-output-gate). The ViT's heads (12) and intermediate (3072) are not in those copies: hidden / 64 and
#   4 x hidden, as Qwen3-VL's ViTs have (unverified);
# * 9B: transformers' Qwen3_5TextConfig defaults, documented as "the Qwen3.5-9B style configuration": vocab 248320,
#   hidden 4096, intermediate 12288, 32 layers, 16 / 4 heads, head_dim 256, linear 16 / 32 heads of 128, kernel 4,
#   untied; a model page's spec of Qwen3.5-9B: 32 layers, hidden 4096, 16 heads, 4 KV heads, 8 of 32 layers gated
#   attention, FFN 12288, 64 rope dimensions, rope base 1e7. Its ViT: Qwen3_5VisionConfig's defaults (depth 27,
#   hidden 1152, 16 heads, intermediate 4304).
# * 27B: a Qwen3_5Config written out with Qwen3.5-27B's config.json values in an image-benchmark judge's code: text
#   64 layers ([L, L, L, F] x 16), hidden 5120, intermediate 17408, 24 / 4 heads, head_dim 256, linear 16 key / 48
#   value heads of 128, conv kernel 4, mrope_section [11, 11, 10] interleaved, partial_rotary_factor 0.25, rope_theta
#   1e7, vocab 248320, untied; vision depth 27, hidden 1152, 16 heads, intermediate 4304, out_hidden 5120, 2304
#   positions; the same LLM in slime's scripts/models/qwen3.5-27B.sh and in other public copies (find_string
#   '"linear_num_value_heads": 48').
# * 2B: two model pages with the model card's facts (24 layers, hidden 2048, FFN 6144, layout 6 x (3 x Gated DeltaNet
#   + 1 x gated attention), linear 16 value / 16 key heads of 128, attention 8 Q / 2 KV heads of 256 with 64 rotary
#   dimensions, vocab 248320; rope theta 1e7 on one of them). Its ViT and tie were not found: the preset takes 4B's
#   ViT and tied embeddings (as 0.8B and 4B have), marked unverified here;
# * 4B: tests/test_qwen3_5_4b_preset.py (its LLM: a Swift test's config.json and onnx_tool's Qwen3_5_4B: 32 layers,
#   hidden 2560, 16 / 4 heads, FFN 9216, linear 16 / 32, tied; its ViT from a fine-tune's config.json).
PUBLISHED = {  # name: (ViT depth, hidden, heads, ffn, LLM layers, hidden, heads, kv, ffn, key heads, value heads, tied)
    "qwen3.5-0.8b": (12, 768, 12, 3072, 24, 1024, 8, 2, 3584, 16, 16, True),
    "qwen3.5-2b": (24, 1024, 16, 4096, 24, 2048, 8, 2, 6144, 16, 16, True),  # ViT, tie unverified (above)
    "qwen3.5-9b": (27, 1152, 16, 4304, 32, 4096, 16, 4, 12288, 16, 32, False),
    "qwen3.5-27b": (27, 1152, 16, 4304, 64, 5120, 24, 4, 17408, 16, 48, False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_sizes(name):
    depth, vh, vheads, vffn, layers, hidden, heads, kv, ffn, nk, nv, tied = PUBLISHED[name]
    spec = get_preset(name)
    v, lang = spec.vision, spec.language
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.ffn_hidden_size) == (depth, vh, vheads, vffn)
    assert v.deepstack_visual_indexes == () and (v.patch_size, v.spatial_merge_size) == (16, 2)
    assert (lang.num_layers, lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.ffn_hidden_size,
            lang.linear_num_key_heads, lang.linear_num_value_heads, lang.tie_word_embeddings) == \
        (layers, hidden, heads, kv, ffn, nk, nv, tied)
    assert (lang.kv_channels, lang.rotary_dim, lang.vocab_size, lang.rotary_base, lang.mrope_section) == \
        (256, 64, 248320, 10000000, (11, 11, 10))
    assert (lang.linear_key_head_dim, lang.linear_value_head_dim, lang.linear_conv_kernel_dim) == (128, 128, 4)
    assert lang.layer_types == ("linear_attention", "linear_attention", "linear_attention", "full_attention") * (layers // 4)
    assert role_summary(spec).startswith(f"I v*{depth} P E t*{layers} L")


def test_spec_round_trips_through_its_dict():
    from omnibal_ext.model.units import spec_from_dict

    spec = get_preset("qwen3.5-tiny")
    assert spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=("linear_attention",) * 5), "layer_types has 5"),
    (dict(layer_types=("linear_attention", "mamba") * 3), "unknown"),
    (dict(linear_num_value_heads=3), "multiple"),
    (dict(mrope_section=(2, 2, 2)), "rotary dimensions"),
])
def test_bad_language_spec_is_refused(change, match):
    with pytest.raises(UserError, match=match):
        dataclasses.replace(get_preset("qwen3.5-tiny").language, **change)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"untied"|"tied": (folder, transformers model)} (seeds ``q.SEEDS``)."""
    return hf_check.untied_and_tied(tmp_path_factory, q.make_tiny, q.SEEDS)


def test_the_oracle_is_exact_to_the_tolerance(tiny):
    """transformers' fp32 logits of both tiny models are within 1e-5 of the exact ones (float64, the delta rule in
    float64 by its closed-form recurrence): a 1e-5 comparison with them judges our rounding, not theirs. The float64
    rule is first checked against transformers' token-by-token rule (float32) on random inputs."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 12, heads, 8, generator=g) for heads in (2, 2, 4)]
    decay, beta = -torch.rand(1, 12, 4, generator=g), torch.rand(1, 12, 4, generator=g)
    want, _ = torch_recurrent_gated_delta_rule(*qkv, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    got, _ = q.delta_rule_fp64(*qkv, g=decay, beta=beta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, (_, model) in tiny.items():
        assert q.oracle_error(model, q.inputs()) <= TOL, name


def test_logits_match_transformers_at_every_cut(megatron_world, tiny):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    batch = q.inputs()
    for name, (folder, model) in tiny.items():
        src = HFSource.open(str(folder))
        kinds = [u.kind for u in build_units(src.spec) if u.code == "t"]
        assert kinds == ["qwen3_5_linear_layer", "qwen3_5_attention_layer", "qwen3_5_attention_layer",
                         "qwen3_5_linear_layer", "qwen3_5_linear_layer"]
        want = q.hf_logits(model, batch)
        got = chained_logits(src, batch)
        assert got.shape == want.shape == (batch["input_ids"].shape[1], q.VOCAB)
        assert (got - want).abs().max() <= TOL, name
        for cut in range(1, len(build_units(src.spec))):
            assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, (name, cut)


# --------------------------------------------------------------------------------------------------
# packed rows: four samples in one micro-batch give the losses and gradients of four micro-batches of one
# --------------------------------------------------------------------------------------------------
def _llm_stage(spec):
    from megatron.vlm.stage.build import StageBuild, build_stage

    units = build_units(spec)
    first = next(u.index for u in units if u.code == "t")
    return build_stage(StageBuild(spec, range(first, len(units)), pp=2, seed=3)), first


def _text_batch(lengths, seed):
    """A micro-batch of text samples of ``lengths`` packed in one row (positions from 0 in each)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    ids = torch.randint(0, 300, (1, t), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).reshape(1, 1, t).expand(3, 1, t).contiguous()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).reshape(1, t)
    return {"tokens": ids, "labels": torch.randint(0, 300, (1, t), generator=g), "mrope_position_ids": pos,
            "cu_seqlens": cu, "max_seqlen": max(lengths), "segment_ids": seg,
            "position_ids": pos[0].clone()}


def test_four_packed_samples_equal_four_micro_batches_of_one(megatron_world):
    """The LLM stage (both layer kinds, head) on a row packing 4 samples vs the same samples one per micro-batch:
    per-token losses and every parameter's and the input's gradient (summed over the 4) within 1e-5; the recurrent
    and convolution state restart in each sample (one segment over the same row is off by far more)."""
    spec = get_preset("qwen3.5-tiny")
    stage, _ = _llm_stage(spec)
    lengths = [7, 1, 12, 6]
    packed = _text_batch(lengths, 0)
    h = spec.language.hidden_size
    x = torch.randn(sum(lengths), 1, h, generator=torch.Generator().manual_seed(5), requires_grad=True)

    def run(batch, inp):
        stage.zero_grad()
        stage.set_input_tensor(inp)
        loss = stage(MicroBatch.of(batch, Qwen3Vision)).loss
        loss.sum().backward()
        return loss.detach().reshape(-1), {n: p.grad.clone() for n, p in stage.named_parameters()}

    want_loss, want_grads = run(packed, x)
    want_dx = x.grad.clone()
    losses, grads, dxs, start = [], None, [], 0
    for i, n in enumerate(lengths):
        one = {k: v for k, v in packed.items()}
        one.update(tokens=packed["tokens"][:, start:start + n], labels=packed["labels"][:, start:start + n],
                   mrope_position_ids=packed["mrope_position_ids"][:, :, start:start + n].contiguous(),
                   cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n,
                   segment_ids=torch.zeros(1, n, dtype=torch.int64), position_ids=torch.arange(n).reshape(1, n))
        xi = x.detach()[start:start + n].clone().requires_grad_()
        loss, g = run(one, xi)
        losses.append(loss)
        dxs.append(xi.grad)
        grads = g if grads is None else {k: grads[k] + g[k] for k in g}
        start += n
    torch.testing.assert_close(torch.cat(losses), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(dxs), want_dx, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)
    # the oracle can fail: one segment over the whole row (state carried across the samples) differs
    whole = dict(packed, cu_seqlens=torch.tensor([0, sum(lengths)], dtype=torch.int32), max_seqlen=sum(lengths))
    stage.set_input_tensor(x.detach())
    with torch.no_grad():
        joined = stage(MicroBatch.of(whole, Qwen3Vision)).loss.reshape(-1)
    assert (joined[7:] - want_loss[7:]).abs().max() > 1e-3


def test_context_parallel_is_refused(megatron_world):
    from megatron.vlm.stage.build import StageBuild, build_stage

    spec = get_preset("qwen3.5-tiny")
    units = build_units(spec)
    first = next(u.index for u in units if u.code == "t")
    with pytest.raises(UserError, match="context parallelism"):
        build_stage(StageBuild(spec, range(first, first + 1), cp=2))


def test_dropping_the_output_gate_or_the_zero_centring_is_caught(megatron_world, tiny, monkeypatch):
    """The logits check above fails by far (>= 1000 x its tolerance) when the gated attention's sigmoid gate is
    skipped (megatron-core's ``Attention._apply_output_gate``) or the norms scale by ``w`` instead of ``1 + w``."""
    from megatron.core.transformer.attention import Attention

    from megatron.vlm.families.qwen3_5 import modules
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    batch = q.inputs()
    folder, model = tiny["untied"]
    src = HFSource.open(str(folder))
    want = q.hf_logits(model, batch)
    assert (chained_logits(src, batch) - want).abs().max() <= TOL
    plain_norm = modules.zero_centred_rms_norm
    for name, patch in (("no output gate", lambda m: m.setattr(Attention, "_apply_output_gate", lambda self, x, g: x)),
                        ("w, not 1 + w", lambda m: m.setattr(modules, "zero_centred_rms_norm",
                                                             lambda x, w, eps: plain_norm(x, w - 1.0, eps)))):
        with monkeypatch.context() as m:
            patch(m)
            diff = (chained_logits(src, batch) - want).abs().max().item()
        assert diff >= 1000 * TOL, (name, diff)
