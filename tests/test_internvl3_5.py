"""InternVL3.5 (dense): InternViT with a Qwen3 LLM. Presets at the published sizes (the facts written here with their
sources); tiny random transformers checkpoints (``hf_tiny``: Qwen3 text with head_dim 12 != hidden 32 / 4 heads, per-head
q/k norms, 3 ViT heads, every parameter perturbed, tied and untied) in the native layout
(``InternVLForConditionalGeneration``, text ``qwen3``) and the original OpenGVLab one (``llm_config``
``Qwen3ForCausalLM``): logits within 1e-5 of transformers (fp32, eager) at every pipeline cut in one process, a model
without the q/k norms off by more than 1000x that, import -> export bit-identical and loaded by transformers; TP2 and PP2
through ``scripts/hf_logits.py`` under torchrun (slow)."""
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny  # noqa: E402
from test_hf_convert import write_original  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.units import build_units, get_preset, unit_components  # noqa: E402

TOL = 1e-5
VARIANTS = {"untied": dict(vit="ln-bias", tie=False), "tied": dict(vit="rms-qknorm", tie=True)}


# --------------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------------
# Published facts. LLM: (layers, hidden, heads, kv heads, head_dim, intermediate, vocab) of the language part's
# Qwen3 config.json: Qwen3-0.6B and Qwen3-8B as OpenGVLab/InternVL3_5-1B's and -8B's llm_config carry them
# (model_type qwen3, rope_theta 1e6, rms_norm_eps 1e-6, attention_bias false, no tie_word_embeddings key);
# Qwen3-1.7B, -4B, -14B, -32B from their config.json. Parameters (billions, vision / language / total): the
# InternVL3.5 quick-start table of OpenGVLab's InternVL docs (docs/en/internvl3.5/quick_start.md).
INTERNVIT_300M = (24, 1024, 16, 4096)  # InternViT-300M-448px-V2_5: layers, hidden, heads, MLP
INTERNVIT_6B = (45, 3200, 25, 12800)  # InternViT-6B-448px-V2_5 (45 of its 48 layers used)
PUBLISHED = {
    "internvl3.5-1b": (INTERNVIT_300M, (28, 1024, 16, 8, 128, 3072, 151936), (0.3, 0.8, 1.1)),
    "internvl3.5-2b": (INTERNVIT_300M, (28, 2048, 16, 8, 128, 6144, 151936), (0.3, 2.0, 2.3)),
    "internvl3.5-4b": (INTERNVIT_300M, (36, 2560, 32, 8, 128, 9728, 151936), (0.3, 4.4, 4.7)),
    "internvl3.5-8b": (INTERNVIT_300M, (36, 4096, 32, 8, 128, 12288, 151936), (0.3, 8.2, 8.5)),
    "internvl3.5-14b": (INTERNVIT_300M, (40, 5120, 40, 8, 128, 17408, 151936), (0.3, 14.8, 15.1)),
    "internvl3.5-38b": (INTERNVIT_6B, (64, 5120, 64, 8, 128, 25600, 151936), (5.5, 32.8, 38.4)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_sizes(name):
    vit, llm, (vision_b, language_b, total_b) = PUBLISHED[name]
    spec = get_preset(name)
    v, lang = spec.vision, spec.language
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.ffn_hidden_size) == vit
    assert (v.image_size, v.patch_size, spec.downsample_ratio, spec.tokens_per_tile) == (448, 14, 0.5, 256)
    assert (lang.num_layers, lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.kv_channels,
            lang.ffn_hidden_size, lang.vocab_size) == llm
    assert lang.qk_norm and not lang.qkv_bias and not lang.tie_word_embeddings
    assert (lang.rotary_base, lang.norm_eps, lang.mrope_section) == (1000000, 1e-6, None)
    params = {code: sum(c.params(1) for c in unit_components(spec) if c.code in code) for code in ("Iv", "EtL", "IvPEtL")}
    assert round(params["Iv"] / 1e9, 1) == vision_b
    assert round(params["EtL"] / 1e9, 1) == language_b
    assert round(params["IvPEtL"] / 1e9, 1) == total_b


# --------------------------------------------------------------------------------------------------
# tiny checkpoints
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"untied"|"tied": (native folder, original folder, transformers model (eager))}."""
    out = {}
    for i, (name, kw) in enumerate(VARIANTS.items()):
        folder = tmp_path_factory.mktemp(f"native-{name}")
        model = hf_tiny.make_tiny(folder, seed=10 + i, text="qwen3", vit_heads=3, head_dim=12, **kw)
        for cfg in (model.config, model.config.vision_config, model.config.text_config):
            cfg._attn_implementation = "eager"
        original = tmp_path_factory.mktemp(f"original-{name}") / "ckpt"
        write_original(model, model.config, original, "qwen3")
        out[name] = (folder, original, model)
    return out


def test_spec_from_both_layouts(tiny):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    for name, (native, original, _) in tiny.items():
        for folder, layout in ((native, "native"), (original, "original")):
            spec, info = spec_from_config(read_config(str(folder)))
            lang = spec.language
            assert (info.layout, info.text_family) == (layout, "qwen3")
            assert (lang.kv_channels, lang.hidden_size, lang.num_attention_heads, lang.kv_groups) == (12, 32, 4, 2)
            assert lang.qk_norm and not lang.qkv_bias and lang.tie_word_embeddings == (name == "tied")


@pytest.mark.parametrize("key, value", [("attention_bias", True),
                                        ("layer_types", ["full_attention", "sliding_attention"])])
def test_unimplemented_qwen3_config_is_refused_naming_the_key(tiny, key, value):
    from megatron.vlm.hf.configs import read_config, spec_from_config

    for folder, part in ((tiny["untied"][0], "text_config"), (tiny["untied"][1], "llm_config")):
        cfg = read_config(str(folder))
        cfg[part][key] = value
        with pytest.raises(UserError, match=key):
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
    # the per-head q/k norms move the logits by far more than the tolerance: a model without them is caught
    attn = [layer.self_attn for layer in model.model.language_model.layers]
    kept = [(a.q_norm, a.k_norm) for a in attn]
    try:
        for a in attn:
            a.q_norm, a.k_norm = torch.nn.Identity(), torch.nn.Identity()
        assert (hf_tiny.hf_logits(model, batch) - got).abs().max() > 1000 * TOL
    finally:
        for a, (q, k) in zip(attn, kept):
            a.q_norm, a.k_norm = q, k


def test_import_export_round_trip_and_transformers_loads_it(megatron_world, tiny, tmp_path):
    from megatron.training.hf_checkpoints import export_hf, import_hf

    pairs = []
    for name, (native, original, _) in tiny.items():
        with_tokenizer = tmp_path / f"original-{name}"
        shutil.copytree(original, with_tokenizer)
        write_context_tokenizer(with_tokenizer, 299)
        for folder, tag in ((native, "native"), (with_tokenizer, "original")):
            out = tmp_path / f"out-{name}-{tag}"
            import_hf(str(folder), str(tmp_path / f"ckpt-{name}-{tag}"))
            export_hf(str(tmp_path / f"ckpt-{name}-{tag}"), str(out))
            hf_check.assert_same_tensors(native, out, (name, tag))  # the original layout comes back in the native one
            config = json.load(open(out / "config.json"))
            assert config["text_config"]["model_type"] == "qwen3" and config["text_config"]["head_dim"] == 12
            if tag == "native":
                assert config == {**json.load(open(native / "config.json")), "dtype": "float32"}
            else:  # an original config names no image token: the folder's tokenizer's <IMG_CONTEXT> is it
                assert config["image_token_id"] == 299
            pairs.append((native, out))
    # transformers loads the exports and gives the source models' logits, in a fresh process (the CPU patches of
    # megatron_world spoil the rotary buffers transformers recomputes in from_pretrained)
    hf_check.assert_transformers_loads_the_same("InternVLForConditionalGeneration", pairs, hf_tiny.inputs(), tmp_path)


def write_context_tokenizer(folder, context_id: int, token: str = "<IMG_CONTEXT>") -> None:
    """A word-level tokenizer whose ``token`` is id ``context_id`` (the ids before it: filler words)."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, context_id)}, token: context_id}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens([token])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "extra_special_tokens": {}}))


@pytest.mark.parametrize("tokenizer, message", [
    (None, "names no image_token_id and no tokenizer folder is known"),
    ("<img>", "has no <IMG_CONTEXT> token"),  # a tokenizer without the context token
    (400, "past the model's 300-token vocabulary")])
def test_export_of_an_original_import_needs_the_tokenizers_context_token(megatron_world, tiny, tmp_path, tokenizer,
                                                                           message):
    """An original-layout config names no image_token_id (transformers refuses a native config without it): without
    a tokenizer whose <IMG_CONTEXT> fits the vocabulary the export is refused, naming what is missing."""
    from megatron.training.hf_checkpoints import export_hf, import_hf

    folder = tmp_path / "original"
    shutil.copytree(tiny["untied"][1], folder)
    if isinstance(tokenizer, str):
        write_context_tokenizer(folder, 299, tokenizer)
    elif tokenizer is not None:
        write_context_tokenizer(folder, tokenizer)
    import_hf(str(folder), str(tmp_path / "ckpt"))
    with pytest.raises(UserError, match=message):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))


# --------------------------------------------------------------------------------------------------
# TP2 / PP2 under torchrun
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_hf_logits_script_under_torchrun(tiny, tmp_path):
    """TP 2 (3 ViT heads padded to 4) and PP 2 with the LLM split, both variants; one launch."""
    batch = hf_tiny.inputs()
    layouts = {"tp2-padded-vit-heads": ["--tensor-model-parallel-size", "2"],
               "pp2-llm-split": ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2PEt|tL"]}
    runs = [(name, what) for what in layouts for name in VARIANTS]
    got = hf_check.torchrun_logits([(tiny[name][0], layouts[what]) for name, what in runs], batch, tmp_path)
    for (name, what), logits in zip(runs, got):
        assert (logits - hf_tiny.hf_logits(tiny[name][2], batch)).abs().max() <= TOL, (name, what)
