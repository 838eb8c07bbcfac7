"""InternVL3.5 with a Qwen3-MoE LLM: presets at the published sizes; tiny random transformers checkpoints (``hf_tiny``:
top-2 of 6 experts of width 20 beside hidden 32 (H != 2I), layer 1 of 3 dense through ``mlp_only_layers``, every
parameter perturbed, ``norm_topk_prob`` both ways) in the native layout (``InternVLForConditionalGeneration``, text
``qwen3_moe``, per-expert tensors) and the original OpenGVLab one (``llm_config`` ``Qwen3MoeForCausalLM``): logits
within 1e-5 of transformers (fp32, eager) at every pipeline cut in one process, the router's renormalisation checked
to matter, import -> export bit-identical and loaded by transformers; EP2, TP2, PP2 and EP2 x TP2 through
``scripts/hf_logits.py`` under torchrun (slow)."""
import json
import re
import shutil
import sys

import pytest

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny  # noqa: E402
from test_hf_convert import write_original  # noqa: E402
from test_internvl3_5 import write_context_tokenizer  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.units import build_units, get_preset, unit_components  # noqa: E402

TOL = 1e-5
VARIANTS = {"topk-raw": dict(norm_topk_prob=False), "topk-normalised": dict(norm_topk_prob=True)}

# --------------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------------
# Published facts. The language parts are Qwen3-30B-A3B and Qwen3-235B-A22B (their config.json, as the Megatron
# model scripts of slime for them carry it: layers, hidden, heads, KV heads, kv_channels 128, ffn_hidden_size,
# moe_ffn_hidden_size, 128 experts, top 8, rope 1e6, vocab 151936, untied; Qwen3-30B-A3B's card: 48 layers, 32 / 4
# heads, 128 experts, 8 active); the ViTs InternViT-300M-448px-V2_5 and InternViT-6B-448px-V2_5 (45 layers used), as
# for the dense InternVL3.5 presets. Totals: the Hugging Face InternVL3.5 collection (OpenGVLab/InternVL3_5-30B-A3B
# "31B", -241B-A28B "241B" parameters).
INTERNVIT_300M = (24, 1024, 16, 4096)
INTERNVIT_6B = (45, 3200, 25, 12800)
PUBLISHED = {  # vit, (layers, hidden, heads, kv, head_dim, ffn, vocab), (experts, topk, expert ffn), total (B)
    "internvl3.5-30b-a3b": (INTERNVIT_300M, (48, 2048, 32, 4, 128, 6144, 151936), (128, 8, 768), 31),
    "internvl3.5-241b-a28b": (INTERNVIT_6B, (94, 4096, 64, 4, 128, 12288, 151936), (128, 8, 1536), 241),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_sizes(name):
    vit, llm, experts, total_b = PUBLISHED[name]
    spec = get_preset(name)
    v, lang, moe = spec.vision, spec.language, spec.language.moe
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.ffn_hidden_size) == vit
    assert (lang.num_layers, lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.kv_channels,
            lang.ffn_hidden_size, lang.vocab_size) == llm
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size) == experts
    assert moe.layer_freq == (1,) * lang.num_layers and moe.norm_topk_prob and moe.score_function == "softmax"
    assert not moe.shared_expert_ffn_hidden_size and lang.qk_norm and not lang.tie_word_embeddings
    assert lang.rotary_base == 1000000
    assert round(sum(c.params(1) for c in unit_components(spec)) / 1e9) == total_b


# --------------------------------------------------------------------------------------------------
# tiny checkpoints
# --------------------------------------------------------------------------------------------------
def write_original_moe(model, native, folder):
    """``model`` in the original OpenGVLab layout: ViT and projector renamed (``write_original``), the LLM's tensors
    as the native files hold them (per expert), ``llm_config`` a Qwen3MoeForCausalLM config."""
    from safetensors.torch import load_file, save_file

    t = model.config.text_config
    write_original(model, model.config, folder, "qwen3")
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items()
               if not k.startswith("language_model.")}
    tensors.update({k: v for k, v in load_file(str(native / "model.safetensors")).items()
                    if k.startswith("language_model.")})
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["llm_config"].update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=t.head_dim,
                                num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
                                moe_intermediate_size=t.moe_intermediate_size, mlp_only_layers=t.mlp_only_layers,
                                decoder_sparse_step=1, norm_topk_prob=t.norm_topk_prob)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{variant: (native folder, original folder, transformers model (eager))}."""
    out = {}
    for i, (name, moe) in enumerate(VARIANTS.items()):
        folder = tmp_path_factory.mktemp(f"native-{name}")
        model = hf_tiny.make_tiny(folder, seed=20 + i, text="qwen3_moe", vit_heads=3, llm_layers=3, moe=moe)
        for cfg in (model.config, model.config.vision_config, model.config.text_config):
            cfg._attn_implementation = "eager"
        original = tmp_path_factory.mktemp(f"original-{name}") / "ckpt"
        write_original_moe(model, folder, original)
        out[name] = (folder, original, model)
    return out


def test_spec_from_both_layouts(tiny):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    for name, (native, original, _) in tiny.items():
        for folder, layout in ((native, "native"), (original, "original")):
            cfg = read_config(str(folder))
            spec, info = spec_from_config(cfg)
            moe = spec.language.moe
            assert (info.layout, info.text_family) == (layout, "qwen3_moe")
            assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.layer_freq) == (6, 2, 20, (1, 0, 1))
            assert moe.norm_topk_prob == (name == "topk-normalised") and not moe.shared_expert_ffn_hidden_size
            assert spec.language.ffn_hidden_size == 48 and [u.kind for u in build_units(spec)
                                                             if u.name.startswith("llm.layer")] == \
                ["llm_moe_layer", "llm_layer", "llm_moe_layer"]
    # the transformers 5 save names the experts num_local_experts, the original config num_experts
    assert "num_local_experts" in read_config(str(tiny["topk-raw"][0]))["text_config"]
    # Qwen3MoeConfig's default: norm_topk_prob False when the key is missing
    cfg = read_config(str(tiny["topk-normalised"][1]))
    del cfg["llm_config"]["norm_topk_prob"]
    assert spec_from_config(cfg)[0].language.moe.norm_topk_prob is False


@pytest.mark.parametrize("part, key, value", [("text_config", "shared_expert_intermediate_size", 16),
                                              ("llm_config", "mlp_only_layers", [5]),
                                              ("text_config", "num_experts_per_tok", 9)])
def test_unimplemented_or_bad_moe_config_is_refused_naming_the_key(tiny, part, key, value):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    native, original, _ = tiny["topk-raw"]
    cfg = read_config(str(native if part == "text_config" else original))
    cfg[part][key] = value
    with pytest.raises(UserError, match=key.split("_")[0] if key != "num_experts_per_tok" else "topk"):
        spec_from_config(cfg)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_at_every_pipeline_cut(megatron_world, tiny, name):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    native, original, model = tiny[name]
    batch = hf_tiny.inputs()
    want = hf_tiny.hf_logits(model, batch)
    src = HFSource.open(str(native))
    n = len(build_units(src.spec))
    for cut in range(1, n):
        assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, cut
    got = chained_logits(src, batch)
    assert got.shape == want.shape and (got - want).abs().max() <= TOL
    orig = chained_logits(HFSource.open(str(original)), batch, img_context_id=299)  # the config names none
    assert (orig - want).abs().max() <= TOL
    # the router's renormalisation moves the logits by far more than the tolerance: a router with the other
    # option would be caught
    for layer in model.model.language_model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.norm_topk_prob = not layer.mlp.gate.norm_topk_prob
    try:
        assert (hf_tiny.hf_logits(model, batch) - got).abs().max() > 1000 * TOL
    finally:
        for layer in model.model.language_model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.norm_topk_prob = not layer.mlp.gate.norm_topk_prob


def test_import_export_round_trip_and_transformers_loads_it(megatron_world, tiny, tmp_path):
    from megatron.training.hf_checkpoints import export_hf, import_hf

    pairs = []
    for name, (native, original, _) in tiny.items():
        with_tokenizer = tmp_path / f"original-{name}"
        shutil.copytree(original, with_tokenizer)
        write_context_tokenizer(with_tokenizer, 299)  # the original config names no image token: the tokenizer's
        for folder, tag in ((native, "native"), (with_tokenizer, "original")):
            out = tmp_path / f"out-{name}-{tag}"
            import_hf(str(folder), str(tmp_path / f"ckpt-{name}-{tag}"))
            export_hf(str(tmp_path / f"ckpt-{name}-{tag}"), str(out))
            hf_check.assert_same_tensors(native, out, (name, tag))  # the original layout comes back in the native one
            config = json.load(open(out / "config.json"))
            if tag == "native":
                assert config == {**json.load(open(native / "config.json")), "dtype": "float32"}
            else:  # written from the spec: the MoE keys read back to the same experts
                text = config["text_config"]
                assert text["model_type"] == "qwen3_moe" and text["mlp_only_layers"] == [1]
                assert text["norm_topk_prob"] == (name == "topk-normalised") and config["image_token_id"] == 299
            pairs.append((native, out))
    # transformers loads the exports and gives the source models' logits (a fresh process: see test_internvl3_5)
    hf_check.assert_transformers_loads_the_same("InternVLForConditionalGeneration", pairs, hf_tiny.inputs(), tmp_path)


# --------------------------------------------------------------------------------------------------
# EP2 / TP2 / PP2 / EP2 x TP2 under torchrun
# --------------------------------------------------------------------------------------------------
PARALLEL = {"ep2": (2, ["--expert-model-parallel-size", "2"]),
            "tp2-sp": (2, ["--tensor-model-parallel-size", "2"]),  # ETP = TP = 2, sequence parallel MoE layers
            "pp2-dense-moe-cut": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2PEtt|tL"]),
            "ep2xtp2": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"])}


@pytest.mark.slow
def test_hf_logits_script_under_torchrun(tiny, tmp_path):
    """Every PARALLEL layout: one launch of 2 ranks, one of 4."""
    folder, _, model = tiny["topk-raw"]
    batch = hf_tiny.inputs()
    want = hf_tiny.hf_logits(model, batch)
    for parallel, got in hf_check.logits_by_layout(folder, batch, tmp_path, PARALLEL).items():
        assert (got - want).abs().max() <= TOL, parallel


def test_hf_logits_refuses_an_expert_grid_naming_the_flag(tiny, tmp_path, monkeypatch, capsys):
    """EP 4 over 6 experts: the trainer's parse-time check, before any weight is read or process group started."""
    sys.path.insert(0, str(hf_tiny.__file__).rsplit("/tests/", 1)[0] + "/scripts")
    import hf_logits

    monkeypatch.setenv("WORLD_SIZE", "4")
    code = hf_logits.main(["--hf-checkpoint", str(tiny["topk-raw"][0]), "--inputs", str(tmp_path / "absent.pt"),
                           "--out", str(tmp_path / "out.pt"), "--expert-model-parallel-size", "4"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf_logits: error:")]
    assert code == 1 and len(err) == 1, err
    assert re.search(r"--expert-model-parallel-size.*4.*6 experts", err[0]), err[0]


# --------------------------------------------------------------------------------------------------
# the trainer's flags with --hf-checkpoint
# --------------------------------------------------------------------------------------------------
def test_hf_checkpoint_fixes_the_experts_and_takes_the_run_flags(tiny, tmp_path):
    from megatron.training.arguments import parse_flags
    from megatron.training.flags import ArgumentError
    from megatron.training.specs import model_spec_of, moe_run_of

    folder = str(tiny["topk-raw"][0])
    args = parse_flags(["--hf-checkpoint", folder, "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01",
                       "--num-experts", "6", "--moe-layer-freq", "[1,0,1]"], world_size=2)  # agreeing flags pass
    spec = model_spec_of(args)
    run = moe_run_of(args, spec)
    assert (spec.language.moe.num_experts, spec.language.moe.norm_topk_prob) == (6, False)
    assert (run.ep, run.etp, run.aux_loss_coeff) == (2, 1, 0.01)
    for flags, named in ((["--num-experts", "8"], "--num-experts 8"),
                         (["--moe-router-topk", "3"], "--moe-router-topk 3"),
                         (["--moe-layer-freq", "[1,1,1]"], r"--moe-layer-freq \[1,1,1\]"),
                         (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function sigmoid"),
                         (["--moe-ffn-hidden-size", "8"], "--moe-ffn-hidden-size 8")):
        with pytest.raises(ArgumentError, match=named):
            parse_flags(["--hf-checkpoint", folder, *flags])
    with pytest.raises(ArgumentError, match="--expert-model-parallel-size"):  # 6 experts over EP 4
        parse_flags(["--hf-checkpoint", folder, "--expert-model-parallel-size", "4"], world_size=4)
    dense = tmp_path / "dense"
    hf_tiny.make_tiny(dense, seed=1, text="qwen3", vit_heads=3)
    with pytest.raises(ArgumentError, match="--expert-model-parallel-size.*dense"):
        parse_flags(["--hf-checkpoint", str(dense), "--expert-model-parallel-size", "2"], world_size=2)
