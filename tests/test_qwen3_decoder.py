"""The Qwen3 decoder shared by every family's LLM: interleaved multimodal RoPE (``megatron/vlm/layers/rope.py``) against
transformers' ``Qwen3VLTextRotaryEmbedding`` and the chunked form against megatron-core's
``MultimodalRotaryEmbedding`` (exact, on random 3-D position ids), and one Qwen3 layer as the shared TextLayer builds
it (per-head q/k RMSNorm, head_dim 12 with hidden 32 / 4 heads, no qkv bias) against transformers'
``Qwen3DecoderLayer`` (fp32, eager, 1e-5). TP 2 of the same layer: tests/test_model_features_tp2.py (slow)."""
import pytest
import torch

pytest.importorskip("transformers")
import tp2_cases  # noqa: E402

from megatron.vlm.layers.rope import MultimodalRope, mrope_axes  # noqa: E402

TOL = 1e-5
# (head_dim, mrope_section): the published Qwen3-VL one, one whose H and W sections differ, one with H > W
SECTIONS = [(128, (24, 20, 20)), (16, (2, 3, 3)), (20, (3, 4, 3)), (8, (1, 2, 1))]


def random_ids(seed=0, b=2, s=23):
    return torch.randint(0, 4000, (3, b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head_dim, section", SECTIONS)
def test_interleaved_mrope_equals_transformers(head_dim, section):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    cfg = Qwen3VLTextConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                            rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                             "mrope_section": list(section), "mrope_interleaved": True})
    ids = random_ids()
    cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), ids)  # [b, s, d]
    ours = MultimodalRope(head_dim, 500000, section, interleaved=True)(ids)  # [s, b, 1, d] angles
    assert torch.equal(ours.squeeze(2).transpose(0, 1).cos(), cos)
    assert torch.equal(ours.squeeze(2).transpose(0, 1).sin(), sin)


@pytest.mark.parametrize("head_dim, section", SECTIONS)
def test_chunked_mrope_equals_megatron_core(megatron_world, head_dim, section):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    ids = random_ids(1)
    want = MultimodalRotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=500000)(ids, list(section))
    assert torch.equal(MultimodalRope(head_dim, 500000, section, interleaved=False)(ids), want)


def test_the_two_forms_differ_where_the_sections_say():
    """Interleaved [24, 20, 20]: T H W repeating for 60 frequencies, then T; chunked: 24 T, 20 H, 20 W."""
    inter, chunked = mrope_axes((24, 20, 20), True), mrope_axes((24, 20, 20), False)
    assert inter[:6].tolist() == [0, 1, 2, 0, 1, 2] and inter[60:].tolist() == [0] * 4
    assert [int((inter == a).sum()) for a in range(3)] == [24, 20, 20]
    assert chunked.tolist() == [0] * 24 + [1] * 20 + [2] * 20
    assert mrope_axes((1, 2, 1), True).tolist() == [0, 1, 2, 0]  # H at 1 and 4 (4 >= 4 frequencies: cut)


def hf_layer_from_ours(layer, lang):
    """transformers' Qwen3DecoderLayer with our layer's weights: the fused QKV split per key-value group (each
    group's q heads, its k head, its v head: megatron-core's layout), gate/up split from linear_fc1."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    cfg = Qwen3Config(hidden_size=lang.hidden_size, num_attention_heads=lang.num_attention_heads,
                      num_key_value_heads=lang.kv_groups, head_dim=lang.kv_channels,
                      intermediate_size=lang.ffn_hidden_size, rms_norm_eps=lang.norm_eps, num_hidden_layers=1,
                      rope_parameters={"rope_type": "default", "rope_theta": float(lang.rotary_base)})
    cfg._attn_implementation = "eager"
    hf = Qwen3DecoderLayer(cfg, 0).eval()
    g, d, per, H = lang.kv_groups, lang.kv_channels, lang.num_attention_heads // lang.kv_groups, lang.hidden_size
    sa, mlp = layer.self_attention, layer.mlp
    qkv = sa.linear_qkv.weight.detach().reshape(g, (per + 2) * d, H)
    F = lang.ffn_hidden_size
    with torch.no_grad():
        hf.self_attn.q_proj.weight.copy_(qkv[:, :per * d].reshape(-1, H))
        hf.self_attn.k_proj.weight.copy_(qkv[:, per * d:(per + 1) * d].reshape(-1, H))
        hf.self_attn.v_proj.weight.copy_(qkv[:, (per + 1) * d:].reshape(-1, H))
        hf.self_attn.o_proj.weight.copy_(sa.linear_proj.weight)
        hf.self_attn.q_norm.weight.copy_(sa.q_layernorm.weight)
        hf.self_attn.k_norm.weight.copy_(sa.k_layernorm.weight)
        hf.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        hf.post_attention_layernorm.weight.copy_(layer.pre_mlp_layernorm.weight)
        hf.mlp.gate_proj.weight.copy_(mlp.linear_fc1.weight[:F])
        hf.mlp.up_proj.weight.copy_(mlp.linear_fc1.weight[F:])
        hf.mlp.down_proj.weight.copy_(mlp.linear_fc2.weight)
    return hf, cfg


def hf_layer_output(hf, cfg, x):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    s = x.shape[0]
    h = x.detach().transpose(0, 1)  # [1, s, H]
    pos = torch.arange(s).unsqueeze(0)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return hf(h, attention_mask=mask, position_ids=pos,
                  position_embeddings=Qwen3RotaryEmbedding(cfg)(h, pos)).transpose(0, 1)


def test_qwen3_layer_equals_transformers(megatron_world):
    from omnibal_ext.model.spec import LanguageSpec

    lang = LanguageSpec(**tp2_cases.QWEN3)
    layer, rope, x, seed = tp2_cases.qwen3_layer_and_input(tp=1)
    assert not hasattr(layer.self_attention.linear_qkv, "bias") or layer.self_attention.linear_qkv.bias is None
    out = tp2_cases.run_qwen3(layer, rope, x, seed).detach()
    hf, cfg = hf_layer_from_ours(layer, lang)
    want = hf_layer_output(hf, cfg, x)
    assert out.shape == want.shape and (out - want).abs().max() <= TOL
    # the q/k norms matter on this layer by far more than the tolerance (a model without them is caught)
    hf.self_attn.q_norm, hf.self_attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    assert (out - hf_layer_output(hf, cfg, x)).abs().max() > 1000 * TOL
