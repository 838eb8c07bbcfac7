"""Hugging Face InternVL in and out (megatron/vlm/hf): config -> spec and its refusals, the key mapping (unknown
keys named), and logits of our model against transformers' on tiny random models (fp32, max |diff| <= 1e-5) at
TP1/PP1, at every pipeline cut in one process, and for the original OpenGVLab layout (the round trip and TP1/TP2/PP2 logits through scripts/hf_logits.py: tests/test_conformance.py)."""
import json

import pytest
import torch

pytest.importorskip("transformers")
import hf_tiny  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402

TOL = 1e-5
CASES = [(vit, text) for vit in ("ln-bias", "rms-qknorm") for text in ("qwen2", "llama")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{(vit, text): (folder, transformers model)}: 3 ViT heads (padded at TP 2), vocabulary 300, Llama with
    head_dim 12 and tied embeddings."""
    out = {}
    for i, (vit, text) in enumerate(CASES):
        folder = tmp_path_factory.mktemp(f"{vit}-{text}")
        out[(vit, text)] = (folder, hf_tiny.make_tiny(folder, seed=i, vit=vit, text=text, vit_heads=3))
    return out


# --------------------------------------------------------------------------------------------------
# config.json -> spec
# --------------------------------------------------------------------------------------------------
def test_spec_from_native_config(tiny):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    spec, info = spec_from_config(read_config(str(tiny[("rms-qknorm", "llama")][0])))
    v, lang = spec.vision, spec.language
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.image_size, v.patch_size) == (2, 24, 3, 28, 7)
    assert (v.normalization, v.qkv_bias, v.qk_norm, v.layer_scale_init) == ("RMSNorm", False, True, 0.1)
    assert (lang.vocab_size, lang.real_vocab_size, lang.head_dim, lang.tie_word_embeddings) == (384, 300, 12, True)
    assert (lang.rotary_base, lang.qkv_bias, lang.num_query_groups) == (50000, False, 2)
    assert spec.tokens_per_tile == hf_tiny.TOKENS_PER_TILE
    assert (info.layout, info.text_family, info.image_token_id) == ("native", "llama", 299)
    spec, info = spec_from_config(read_config(str(tiny[("ln-bias", "qwen2")][0])))
    assert spec.language.qkv_bias and not spec.language.tie_word_embeddings and spec.vision.qkv_bias


@pytest.mark.parametrize("where, key, value", [
    ("text_config", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
    ("text_config", "rope_scaling", {"type": "linear", "factor": 2.0}),
    ("", "projector_hidden_act", "relu"),
    ("vision_config", "use_mean_pooling", False),
    ("", "vision_feature_select_strategy", "full"),
    ("text_config", "model_type", "mistral"),
    ("vision_config", "norm_type", "batch_norm"),
])
def test_unimplemented_config_is_refused_naming_the_key(tiny, where, key, value):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    cfg = read_config(str(tiny[("ln-bias", "qwen2")][0]))
    (cfg[where] if where else cfg)[key] = value
    with pytest.raises(UserError, match=key):
        spec_from_config(cfg)


# --------------------------------------------------------------------------------------------------
# import -> export, unknown keys
# --------------------------------------------------------------------------------------------------
def test_unknown_and_missing_tensors_are_listed(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.recipes import HFKeysError

    folder, _ = tiny[("ln-bias", "qwen2")]
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["vision_tower.encoder.layer.0.attention.extra.weight"] = torch.zeros(2)
    del t["language_model.model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(HFKeysError, match=r"attention\.extra\.weight") as e:
        HFSource.open(str(bad))
    assert "layers.1.mlp.up_proj.weight" in str(e.value)


@pytest.mark.parametrize("cut", [0.5, 0.001], ids=["data-cut", "header-cut"])
def test_a_truncated_safetensors_file_is_named(tiny, tmp_path, cut):
    import shutil

    from megatron.vlm.hf.config import HFConfigError
    from megatron.vlm.hf.convert import HFSource

    folder, _ = tiny[("ln-bias", "qwen2")]
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(HFConfigError, match=f"--hf-checkpoint {bad}: {bad / 'model.safetensors'} is not a readable "
                                            "safetensors file .*truncated or damaged"):
        HFSource.open(str(bad))


def test_export_to_a_file_is_refused_before_reading(tmp_path, capsys):
    """`omnibal hf export --out FILE`: one line, exit 1, before the checkpoint is read (there is none here)."""
    from omnibal_cli import main as omnibal

    out = tmp_path / "exported"
    out.write_text("x")
    assert omnibal(["hf", "export", "--load", str(tmp_path / "none"), "--out", str(out)]) == 1
    assert capsys.readouterr().err == (f"omnibal hf export: error: --out {out}: {out} is a file, not a folder: give a "
                                       "folder to write the Hugging Face model into\n")
    assert omnibal(["hf", "export", "--load", str(tmp_path / "none"), "--out", str(out / "sub")]) == 1
    assert f"--out {out / 'sub'}: {out} is a file" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# logits against transformers
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[f"{v}-{t}" for v, t in CASES])
def test_logits_match_transformers(megatron_world, tiny, case):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    folder, model = tiny[case]
    batch = hf_tiny.inputs()
    want = hf_tiny.hf_logits(model, batch)
    got = chained_logits(HFSource.open(str(folder)), batch)
    assert got.shape == want.shape == (batch["input_ids"].shape[1], 300)
    assert (got - want).abs().max() <= TOL


def test_logits_match_at_every_pipeline_cut(megatron_world, tiny):
    from omnibal_ext.model.units import build_units

    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    folder, model = tiny[("rms-qknorm", "llama")]  # tied embeddings: E and L on different stages
    src = HFSource.open(str(folder))
    batch = hf_tiny.inputs(tiles=3)
    want = hf_tiny.hf_logits(model, batch)
    n = len(build_units(src.spec))
    for cut in range(1, n):
        assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, cut
    assert (chained_logits(src, batch, list(range(1, n))) - want).abs().max() <= TOL  # one unit per stage


def write_original(model, cfg, folder, family):
    """``model``'s tensors under the original OpenGVLab names and fused layouts, with an original config."""
    from safetensors.torch import save_file

    folder.mkdir()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    v, t = cfg.vision_config, cfg.text_config
    out = {}
    e = "model.vision_tower.embeddings."
    out["vision_model.embeddings.class_embedding"] = sd[e + "cls_token"]
    out["vision_model.embeddings.position_embedding"] = sd[e + "position_embeddings"]
    for w in ("weight", "bias"):
        out[f"vision_model.embeddings.patch_embedding.{w}"] = sd[e + f"patch_embeddings.projection.{w}"]
    for i in range(v.num_hidden_layers):
        s, o = f"model.vision_tower.encoder.layer.{i}.", f"vision_model.encoder.layers.{i}."
        out[o + "attn.qkv.weight"] = torch.cat([sd[s + f"attention.{x}_proj.weight"] for x in "qkv"])
        if v.attention_bias:
            out[o + "attn.qkv.bias"] = torch.cat([sd[s + f"attention.{x}_proj.bias"] for x in "qkv"])
        if v.use_qk_norm:
            out[o + "attn.q_norm.weight"] = sd[s + "attention.q_norm.weight"]
            out[o + "attn.k_norm.weight"] = sd[s + "attention.k_norm.weight"]
        for w in ("weight", "bias"):
            out[o + f"attn.proj.{w}"] = sd[s + f"attention.projection_layer.{w}"]
            out[o + f"mlp.fc1.{w}"] = sd[s + f"mlp.fc1.{w}"]
            out[o + f"mlp.fc2.{w}"] = sd[s + f"mlp.fc2.{w}"]
        out[o + "ls1"], out[o + "ls2"] = sd[s + "lambda_1"], sd[s + "lambda_2"]
        for src_name, dst in (("layernorm_before", "norm1"), ("layernorm_after", "norm2")):
            for w in ("weight", "bias"):
                if s + f"{src_name}.{w}" in sd:
                    out[o + f"{dst}.{w}"] = sd[s + f"{src_name}.{w}"]
    for src_name, dst in (("layer_norm", "0"), ("linear_1", "1"), ("linear_2", "3")):
        for w in ("weight", "bias"):
            out[f"mlp1.{dst}.{w}"] = sd[f"model.multi_modal_projector.{src_name}.{w}"]
    L = "model.language_model."
    heads, groups = t.num_attention_heads, t.num_key_value_heads
    d = t.hidden_size // heads
    if family == "internlm2":
        out["language_model.model.tok_embeddings.weight"] = sd[L + "embed_tokens.weight"]
        for i in range(t.num_hidden_layers):
            s, o = f"{L}layers.{i}.", f"language_model.model.layers.{i}."
            q = sd[s + "self_attn.q_proj.weight"].reshape(groups, heads // groups * d, -1)
            k = sd[s + "self_attn.k_proj.weight"].reshape(groups, d, -1)
            vv = sd[s + "self_attn.v_proj.weight"].reshape(groups, d, -1)
            out[o + "attention.wqkv.weight"] = torch.cat([q, k, vv], 1).reshape(-1, t.hidden_size)
            out[o + "attention.wo.weight"] = sd[s + "self_attn.o_proj.weight"]
            out[o + "feed_forward.w1.weight"] = sd[s + "mlp.gate_proj.weight"]
            out[o + "feed_forward.w3.weight"] = sd[s + "mlp.up_proj.weight"]
            out[o + "feed_forward.w2.weight"] = sd[s + "mlp.down_proj.weight"]
            out[o + "attention_norm.weight"] = sd[s + "input_layernorm.weight"]
            out[o + "ffn_norm.weight"] = sd[s + "post_attention_layernorm.weight"]
        out["language_model.model.norm.weight"] = sd[L + "norm.weight"]
        out["language_model.output.weight"] = sd["lm_head.weight"]
        llm = {"model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"], "bias": False}
    else:
        for k, val in sd.items():
            if k.startswith(L):
                out["language_model.model." + k[len(L):]] = val
        out["language_model.lm_head.weight"] = sd["lm_head.weight"]
        llm = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
        if family == "qwen3":  # InternVL3.5: Qwen3ForCausalLM (q_norm / k_norm copied with the rest)
            llm = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": t.head_dim,
                   "attention_bias": False}
    llm.update(hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers, num_attention_heads=heads,
               num_key_value_heads=groups, intermediate_size=t.intermediate_size, vocab_size=t.vocab_size,
               rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_parameters["rope_theta"], hidden_act="silu",
               tie_word_embeddings=bool(cfg.tie_word_embeddings))
    vision = {"hidden_size": v.hidden_size, "num_hidden_layers": v.num_hidden_layers,
              "num_attention_heads": v.num_attention_heads, "intermediate_size": v.intermediate_size,
              "image_size": hf_tiny.IMAGE, "patch_size": hf_tiny.PATCH, "qkv_bias": v.attention_bias,
              "qk_normalization": v.use_qk_norm, "norm_type": v.norm_type, "layer_norm_eps": v.layer_norm_eps,
              "initializer_factor": 0.1, "hidden_act": "gelu"}
    config = {"architectures": ["InternVLChatModel"], "vision_config": vision, "llm_config": llm,
              "downsample_ratio": 0.5, "select_layer": -1, "ps_version": "v2", "template": "internlm2-chat"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: x.contiguous() for k, x in out.items()}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("vit, family", [("rms-qknorm", "internlm2"), ("ln-bias", "qwen2")])
def test_original_layout_gives_the_native_logits(megatron_world, tmp_path, vit, family):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    text = "llama" if family == "internlm2" else "qwen2"
    model = hf_tiny.make_tiny(tmp_path / "native", seed=5, vit=vit, text=text, vit_heads=3, tie=False, head_dim=None)
    write_original(model, model.config, tmp_path / "orig", family)
    src = HFSource.open(str(tmp_path / "orig"))
    assert (src.info.layout, src.info.text_family) == ("original", family)
    batch = hf_tiny.inputs()
    want = hf_tiny.hf_logits(model, batch)
    assert (chained_logits(src, batch, img_context_id=299) - want).abs().max() <= TOL
    assert (chained_logits(src, batch, [4], img_context_id=299) - want).abs().max() <= TOL


# --------------------------------------------------------------------------------------------------
# TP2 / PP2 under torchrun
# --------------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------------
# --hf-checkpoint at launch and in `omnibal plan`: the model comes from config.json
# --------------------------------------------------------------------------------------------------
def test_hf_checkpoint_flag_gives_the_model_and_refuses_conflicts(tiny):
    from megatron.training.flags import ArgumentError, build_parser
    from megatron.training.specs import model_spec_of
    from megatron.training.validation import validate_flags
    from megatron.vlm.hf.configs import read_config, spec_from_config

    folder = str(tiny[("rms-qknorm", "llama")][0])
    want, _ = spec_from_config(read_config(folder), "x")
    args = build_parser().parse_args(["--hf-checkpoint", folder, "--hidden-size", "32", "--head-dim", "12"])
    validate_flags(args, 1)  # flags that agree are fine
    assert model_spec_of(args).replace(name="x") == want
    for bad in (["--hidden-size", "64"], ["--model", "internvl3-1b"], ["--no-tie-word-embeddings"]):
        with pytest.raises(ArgumentError, match="--hf-checkpoint|--model"):
            validate_flags(build_parser().parse_args(["--hf-checkpoint", folder, *bad]), 1)


def test_plan_takes_the_model_from_hf_checkpoint(tiny, tmp_path):
    from omnibal_cli import main

    folder = str(tiny[("ln-bias", "qwen2")][0])
    g = torch.Generator().manual_seed(0)
    stats = [{"vit_num": int(torch.randint(1, 4, (1,), generator=g)), "token_num": int(torch.randint(20, 120, (1,), generator=g))}
             for _ in range(400)]
    (tmp_path / "s.json").write_text(json.dumps(stats))
    out = tmp_path / "plan.json"
    assert main(["plan", "--data", str(tmp_path / "s.json"), "--hf-checkpoint", folder, "--gpus", "2", "--gpu-memory",
                 "1", "--global-batch-size", "16", "--sim-iterations", "2", "--json", str(out)]) == 0
    flags = json.loads(out.read_text())["trainer_flags"]
    assert flags["--hf-checkpoint"] == folder and "--model" not in flags


def test_recipe_read_into_equals_read():
    """``Recipe.read_into`` (chunked, written in place, as --hf-checkpoint loads) gives ``read``'s values
    bit for bit: row blocks of several tensors, zero rows, column cuts, strided destinations, dtypes."""
    from megatron.vlm.hf.recipes import Part, Recipe

    g = torch.Generator().manual_seed(0)
    hf = {"a": torch.randn(12, 10, generator=g).bfloat16(), "b": torch.randn(6, 10, generator=g).bfloat16(),
          "c": torch.randn(10, 12, generator=g).bfloat16()}

    class Reader:
        def box(self, name, rows, cols=None):
            t = hf[name][rows[0]:rows[1]]
            return (t if cols is None else t[:, cols[0]:cols[1]]).clone()

    gated = Recipe((22, 10), (Part("a", 0, 12), Part("b", 2, 6), Part(None, 0, 6)))
    per_head = Recipe((4, 10, 3), tuple(Part("c", 0, 10, (h * 3, (h + 1) * 3)) for h in range(4)), 10)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for first, last, cols in ((0, 22, None), (5, 17, None), (3, 20, (2, 7))):
            want = gated.read(Reader(), first, last, torch.float32, cols=cols).to(dtype)
            big = torch.full((last - first, 13), 7.0, dtype=dtype)
            out = big[:, 1:1 + want.shape[1]]  # a strided view, like a parameter's slice
            gated.read_into(Reader(), out, first, last, cols=cols, chunk_bytes=50)
            assert torch.equal(out, want) and (big[:, 0] == 7).all()
        want = per_head.read(Reader(), 1, 3, torch.float32).to(dtype)
        param = torch.zeros(10, 12, dtype=dtype)
        for h in (1, 2):  # head h's input columns of the output projection, written in place
            per_head.read_into(Reader(), param[:, h * 3:(h + 1) * 3], h, h + 1, chunk_bytes=8)
        assert torch.equal(param[:, 3:9], torch.cat(list(want), 1)) and (param[:, :3] == 0).all()
