"""Model features the real InternVL checkpoints need, checked in one process (a world of one, gloo):
layer parity against transformers' InternVL vision layer, Qwen2 and Llama decoder layers (the independent
reference), vocabulary padding left out of the loss, tied embeddings, sharded state dicts, spec round trip."""
import dataclasses

import pytest
import torch

from omnibal_ext.errors import UserError
from megatron.vlm.families.internvl.hf import vit_layers_for_feature_layer
from omnibal_ext.model.units import build_units, get_preset, spec_from_dict


def perturb_named(module, seed=0):
    """Every parameter random (HF init leaves norms, layer scales and biases constant, which would hide
    swapped keys); norm weights and layer scales around 1 so they stay of order one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.2 * noise if (p.dim() > 1 or name.endswith("bias")) else 1.0 + 0.3 * noise)


def build_layer(cfg, normalization, mask_type, real_heads=None, vision=None):
    from megatron.core.transformer.spec_utils import build_module

    from megatron.vlm.families.internvl.layers import layer_spec as _layer_spec

    return build_module(_layer_spec(normalization, mask_type, 0, 0, real_heads=real_heads, vision=vision),
                        config=cfg, layer_number=1)


def run_layer(layer, x, **kw):
    out = layer(hidden_states=x, **kw)
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------------------------------
# ViT layer against transformers' InternVLVisionLayer
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm, qkv_bias, qk_norm", [("LayerNorm", True, False), ("RMSNorm", False, True)],
                         ids=["layernorm-bias", "rmsnorm-qknorm"])
def test_vit_layer_matches_transformers_internvl(megatron_world, norm, qkv_bias, qk_norm):
    pytest.importorskip("transformers")
    from megatron.core.transformer.enums import AttnMaskType
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionLayer

    from megatron.vlm.layers.config import vision_config

    H, heads, F_, eps, ls = 64, 4, 128, 1e-6, 0.1
    hf_cfg = InternVLVisionConfig(hidden_size=H, num_attention_heads=heads, intermediate_size=F_,
                                  attention_bias=qkv_bias, use_qk_norm=qk_norm,
                                  norm_type="layer_norm" if norm == "LayerNorm" else "rms_norm",
                                  layer_norm_eps=eps, layer_scale_init_value=ls, hidden_act="gelu",
                                  attention_dropout=0.0, projection_dropout=0.0, hidden_dropout_prob=0.0)
    hf_cfg._attn_implementation = "eager"
    ref = InternVLVisionLayer(hf_cfg).eval()
    perturb_named(ref, seed=1)

    base = get_preset("tiny")
    vision = dataclasses.replace(base.vision, hidden_size=H, num_attention_heads=heads, ffn_hidden_size=F_,
                                 normalization=norm, norm_eps=eps, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                 layer_scale_init=ls)
    spec = base.replace(vision=vision)
    ours = build_layer(vision_config(spec, 1, True, torch.float32), norm, AttnMaskType.no_mask,
                       real_heads=heads, vision=vision).eval()
    d = H // heads
    a = ref.attention
    sd = {
        "input_layernorm.weight": ref.layernorm_before.weight,
        "pre_mlp_layernorm.weight": ref.layernorm_after.weight,
        # megatron-core's fused QKV of multi-head attention: per head, rows [q_h; k_h; v_h]
        "self_attention.linear_qkv.weight": torch.stack(
            [w.weight.reshape(heads, d, H) for w in (a.q_proj, a.k_proj, a.v_proj)], 1).reshape(3 * H, H),
        "self_attention.linear_proj.weight": a.projection_layer.weight,
        "self_attention.linear_proj.bias": a.projection_layer.bias,
        "self_attn_bda.scale": ref.lambda_1, "mlp_bda.scale": ref.lambda_2,
        "mlp.linear_fc1.weight": ref.mlp.fc1.weight, "mlp.linear_fc1.bias": ref.mlp.fc1.bias,
        "mlp.linear_fc2.weight": ref.mlp.fc2.weight, "mlp.linear_fc2.bias": ref.mlp.fc2.bias,
    }
    if norm == "LayerNorm":
        sd["input_layernorm.bias"] = ref.layernorm_before.bias
        sd["pre_mlp_layernorm.bias"] = ref.layernorm_after.bias
    if qkv_bias:
        sd["self_attention.linear_qkv.bias"] = torch.stack(
            [w.bias.reshape(heads, d) for w in (a.q_proj, a.k_proj, a.v_proj)], 1).reshape(3 * H)
    if qk_norm:
        sd["self_attention.q_layernorm.weight"] = a.q_norm.weight
        sd["self_attention.k_layernorm.weight"] = a.k_norm.weight
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) == set(sd), set(ours_params) ^ set(sd)  # every parameter mapped, none extra
    with torch.no_grad():
        for k, v in sd.items():
            ours_params[k].copy_(v)
    x = torch.randn(3, 17, H, generator=torch.Generator().manual_seed(2))  # [tiles, tokens, H]
    with torch.no_grad():
        want = ref(x)
        got = run_layer(ours, x.transpose(0, 1).contiguous(), attention_mask=None).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# LLM decoder layer against transformers' Qwen2 (qkv bias) and Llama (explicit head_dim)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_llm_layer_matches_transformers(megatron_world, family):
    pytest.importorskip("transformers")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.vlm.layers.config import language_config

    H, heads, groups, F_, eps, theta = 64, 4, 2, 96, 1e-6, 50000.0
    d = 24 if family == "llama" else H // heads
    common = dict(hidden_size=H, num_attention_heads=heads, num_key_value_heads=groups, intermediate_size=F_,
                  rms_norm_eps=eps, num_hidden_layers=1, vocab_size=128, hidden_act="silu",
                  rope_parameters={"rope_type": "default", "rope_theta": theta})
    if family == "qwen2":
        from transformers import Qwen2Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as Layer
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding as Rope

        hf_cfg = Qwen2Config(**common)
    else:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Layer
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rope

        hf_cfg = LlamaConfig(**common, head_dim=d, attention_bias=False, mlp_bias=False)
    hf_cfg._attn_implementation = "eager"
    ref = Layer(hf_cfg, layer_idx=0).eval()
    perturb_named(ref, seed=3)

    base = get_preset("tiny")
    lang = dataclasses.replace(base.language, hidden_size=H, num_attention_heads=heads, num_query_groups=groups,
                               ffn_hidden_size=F_, norm_eps=eps, rotary_base=int(theta),
                               qkv_bias=family == "qwen2", head_dim=d if family == "llama" else None)
    spec = base.replace(language=lang)
    assert lang.kv_channels == d
    ours = build_layer(language_config(spec, 1, True, torch.float32), "RMSNorm", AttnMaskType.causal).eval()
    at, mlp = ref.self_attn, ref.mlp
    per = heads // groups

    def fused(tensors):  # per key-value group: its query heads, then k, then v
        q, k, v = tensors
        q = q.reshape(groups, per * d, *q.shape[1:])
        k, v = (t.reshape(groups, d, *t.shape[1:]) for t in (k, v))
        return torch.cat([q, k, v], 1).reshape(-1, *q.shape[2:])

    sd = {
        "input_layernorm.weight": ref.input_layernorm.weight,
        "pre_mlp_layernorm.weight": ref.post_attention_layernorm.weight,
        "self_attention.linear_qkv.weight": fused([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]),
        "self_attention.linear_proj.weight": at.o_proj.weight,
        "mlp.linear_fc1.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        "mlp.linear_fc2.weight": mlp.down_proj.weight,
    }
    if family == "qwen2":
        sd["self_attention.linear_qkv.bias"] = fused([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias])
        assert at.o_proj.bias is None
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) == set(sd), set(ours_params) ^ set(sd)
    with torch.no_grad():
        for k, v in sd.items():
            ours_params[k].copy_(v)
    b, s = 2, 11
    x = torch.randn(b, s, H, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    causal = torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_base=int(theta), use_cpu_initialization=True)
    with torch.no_grad():
        want = ref(x, attention_mask=causal, position_ids=pos, position_embeddings=Rope(hf_cfg)(x, pos))
        want = want[0] if isinstance(want, tuple) else want
        got = run_layer(ours, x.transpose(0, 1).contiguous(), attention_mask=None,
                        rotary_pos_emb=rope(s)).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Vocabulary padding, tied embeddings, sharded state dicts
# --------------------------------------------------------------------------------------------------
def whole_model(spec, seed=3, unit_range=None):
    from megatron.vlm.stage.build import StageBuild, build_stage

    units = build_units(spec)
    return build_stage(StageBuild(spec, unit_range or range(len(units)), img_context_id=263, seed=seed))


def with_language(spec, **changes):
    return spec.replace(language=dataclasses.replace(spec.language, **changes))


def digits_batch(tmp_path, spec, n=4):
    from megatron.vlm.data.collate import collate_padded
    from megatron.vlm.data.digits import build_digits_dataset
    from megatron.vlm.data import RecordDataset, TileImages
    from megatron.vlm.data.tokenizer import ByteTokenizer
    from megatron.vlm.stage.micro_batch import MicroBatch

    tok = ByteTokenizer()
    meta = build_digits_dataset(str(tmp_path / "digits"), num_samples=20, tile_size=spec.vision.image_size)
    ds = RecordDataset(meta, tok, TileImages(spec.vision.image_size, spec.tokens_per_tile, 6), 512)
    return MicroBatch.of(collate_padded([ds[i] for i in range(n)], tok.pad_id)), tok.vocab_size


def copy_real_rows(src, dst):
    """dst's parameters from src's, the vocabulary matrices cut to dst's rows."""
    dst_sd = dst.state_dict()
    with torch.no_grad():
        for k, v in src.state_dict().items():
            if k in dst_sd and dst_sd[k] is not None and hasattr(v, "shape"):
                dst_sd[k].copy_(v[: dst_sd[k].shape[0]] if v.shape != dst_sd[k].shape else v)


def test_vocabulary_padding_does_not_change_the_loss(megatron_world, tmp_path):
    spec = get_preset("tiny")
    batch, real = digits_batch(tmp_path, spec)
    assert real == 264 and spec.language.vocab_size == 384
    padded = whole_model(with_language(spec, real_vocab_size=real)).eval()
    unmasked = whole_model(spec).eval()
    unpadded = whole_model(with_language(spec, vocab_size=real)).eval()
    copy_real_rows(padded, unpadded)
    with torch.no_grad():
        loss, correct = padded(batch)
        want, want_correct = unpadded(batch)
        old = unmasked(batch).loss
    answer = batch.text.labels != -100
    torch.testing.assert_close(loss[answer], want[answer], rtol=1e-6, atol=1e-6)
    assert torch.equal(correct[answer], want_correct[answer])
    assert (old[answer] - want[answer]).mean() > 0.05  # the padded rows did take part before


def test_tied_embeddings_share_one_weight_and_split_stages_draw_the_same(megatron_world):
    spec = with_language(get_preset("tiny"), tie_word_embeddings=True)
    whole = whole_model(spec)
    assert whole.head.output.weight is whole.text_embed.word.weight
    names = [n for n, _ in whole.named_parameters()]
    assert "head.output.weight" not in names  # one parameter for the optimizer
    untied = whole_model(get_preset("tiny"))
    assert torch.equal(whole.text_embed.word.weight, untied.text_embed.word.weight)  # same draw as untied E
    units = build_units(spec)
    e = next(u.index for u in units if u.kind == "llm_embed")
    first, last = whole_model(spec, unit_range=range(0, e + 1)), whole_model(spec, unit_range=range(e + 1, len(units)))
    assert torch.equal(last.head.output.weight, first.text_embed.word.weight)
    assert getattr(last.head.output.weight, "shared", False)  # counted once in the gradient norm
    assert last.tied_embedding_weight() is last.head.output.weight
    assert first.tied_embedding_weight() is first.text_embed.word.weight
    # both stages save the tied weight under their units' names, so any layout loads any checkpoint
    assert "llm.head.output.weight" in {v.key for v in last.sharded_state_dict().values()}
    assert "llm.head.output.weight" in {v.key for v in whole.sharded_state_dict().values() if hasattr(v, "key")}


def _sharded_shapes(sd):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}

    def visit(v):
        if isinstance(v, ShardedTensorFactory):
            visit(v.build())
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, ShardedTensor):
            out.setdefault(v.key, set()).add(v.global_shape)

    visit(sd)
    return out


def test_sharded_state_dict_has_every_new_parameter(megatron_world):
    base = get_preset("tiny")
    vision = dataclasses.replace(base.vision, num_attention_heads=4, normalization="RMSNorm", qkv_bias=False,
                                 qk_norm=True, layer_scale_init=0.1)
    spec = with_language(base.replace(vision=vision), qkv_bias=True, head_dim=24)
    m = whole_model(spec)
    sd = m.sharded_state_dict()
    shapes = _sharded_shapes(sd)
    H, d, heads = 64, 16, 4
    want = {
        "vit.layer.1.self_attention.q_layernorm.weight": (heads, d),
        "vit.layer.1.self_attention.k_layernorm.weight": (heads, d),
        "vit.layer.1.self_attention.linear_qkv.weight": (heads, 3 * d, H),
        "vit.layer.1.self_attn_bda.scale": (H,),
        "vit.layer.1.mlp_bda.scale": (H,),
        "llm.layer.2.self_attention.linear_qkv.bias": ((4 + 2 * 2) * 24,),
        "llm.layer.2.self_attention.linear_qkv.weight": ((4 + 2 * 2) * 24, 64),
        "llm.layer.2.self_attention.linear_proj.weight": (64, 4 * 24),
    }
    for key, shape in want.items():
        assert shapes.get(key) == {shape}, (key, shapes.get(key))
    assert "vit.layer.1.self_attention.linear_qkv.bias" not in shapes
    # every parameter of the stage is saved
    assert {n for n, _ in m.named_parameters()} <= set(sd)


# --------------------------------------------------------------------------------------------------
# Spec, flags, position table
# --------------------------------------------------------------------------------------------------
def test_spec_round_trip_and_presets():
    spec = get_preset("internvl-6b-20b")
    assert (spec.vision.normalization, spec.vision.qk_norm, spec.vision.qkv_bias) == ("RMSNorm", True, False)
    assert spec.vision.layer_scale_init == 0.1
    assert not spec.language.qkv_bias and not spec.language.tie_word_embeddings
    custom = with_language(spec, head_dim=96, qkv_bias=True, norm_eps=1e-6, real_vocab_size=92500,
                           tie_word_embeddings=True)
    assert spec_from_dict(custom.to_dict()) == custom
    old = spec.to_dict()
    for k in ("norm_eps", "qkv_bias", "qk_norm", "layer_scale_init"):
        old["vision"].pop(k)
    assert spec_from_dict(old).vision.qkv_bias  # older dicts: today's defaults
    tiny = get_preset("tiny")
    assert (tiny.vision.qkv_bias, tiny.vision.qk_norm, tiny.vision.layer_scale_init) == (True, False, None)
    with pytest.raises(UserError, match="'yarn'"):
        with_language(tiny, rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_vision_feature_layer_mapping_and_flags():
    from megatron.training.flags import ArgumentError, build_parser
    from megatron.training.specs import model_spec_from_flags

    assert vit_layers_for_feature_layer(45, -1) == 45
    assert vit_layers_for_feature_layer(48, -4) == 45
    assert vit_layers_for_feature_layer(24, 12) == 12
    with pytest.raises(UserError):
        vit_layers_for_feature_layer(4, -5)
    args = build_parser().parse_args([
        "--vision-feature-layer", "-2", "--vision-normalization", "RMSNorm", "--no-vision-qkv-bias",
        "--vision-qk-norm", "--vision-layer-scale-init", "1.0", "--qkv-bias", "--head-dim", "32",
        "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--tie-word-embeddings"])
    spec = model_spec_from_flags(args)
    v, lang = spec.vision, spec.language
    assert (v.num_layers, v.normalization, v.qkv_bias, v.qk_norm, v.layer_scale_init) == (3, "RMSNorm", False, True, 1.0)
    assert (lang.qkv_bias, lang.head_dim, lang.norm_eps, lang.rotary_base, lang.tie_word_embeddings) == \
        (True, 32, 1e-6, 1000000, True)
    assert model_spec_from_flags(build_parser().parse_args([])) == get_preset("tiny")
    with pytest.raises(ArgumentError, match="--vision-layer-scale-init"):
        model_spec_from_flags(build_parser().parse_args(["--vision-layer-scale-init", "big"]))

