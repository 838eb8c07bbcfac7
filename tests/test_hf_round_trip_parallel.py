"""HF -> trainer checkpoint written at TP2 or PP2 -> `omnibal hf export` is bit-identical to the source folder, for
tiny Qwen3-VL (DeepStack at the first and last ViT layer; PP2 cut where a DeepStack feature crosses) and InternVL3.5
(InternViT + Qwen3) checkpoints, tied and untied: the trainer loads --hf-checkpoint, saves at iteration 0
(``--train-iters 0``: no step, the weights as loaded) from its TP/PP shards, and the export puts every tensor back
(slow)."""
from __future__ import annotations

import json

import pytest
import torch

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import hf_tiny  # noqa: E402
import hf_tiny_qwen  # noqa: E402
import hf_tiny_qwen3_vl  # noqa: E402

pytestmark = pytest.mark.slow


def qwen3_vl_folder(folder, tie: bool):
    """A tiny Qwen3-VL folder with a tokenizer (``hf_tiny_qwen``'s, the config's image ids pointed at it) and
    Qwen3-VL's preprocessor_config.json (16 px patches, 2 x 2 merged, mean/std 0.5), which its data side needs."""
    folder.mkdir()
    ids = hf_tiny_qwen.write_tokenizer(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 16}}))
    model = hf_tiny_qwen3_vl.make_tiny(folder, seed=4, tie=tie)
    hf_tiny_qwen.set_token_ids(model, ids)
    model.save_pretrained(str(folder))


def internvl3_5_folder(folder, tie: bool):
    hf_tiny.make_tiny_with_tokenizer(folder, seed=5, text="qwen3", vit_heads=3, head_dim=12, tie=tie)


CASES = {
    "qwen3-vl-tied-tp2": (qwen3_vl_folder, True, ["--tensor-model-parallel-size", "2"]),
    # DeepStack feature 0 (ViT layer 0) crosses into the second stage's ViT and LLM layers
    "qwen3-vl-untied-pp2": (qwen3_vl_folder, False, ["--pipeline-model-parallel-size", "2",
                                                     "--pipeline-layout", "Iv*2|v*2PEt*3L"]),
    "internvl3.5-untied-tp2": (internvl3_5_folder, False, ["--tensor-model-parallel-size", "2"]),
    "internvl3.5-tied-pp2": (internvl3_5_folder, True, ["--pipeline-model-parallel-size", "2",
                                                         "--pipeline-layout", "Iv*2PEt|tL"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_of_a_tp2_or_pp2_checkpoint_is_the_source(tmp_path, case):
    from safetensors.torch import load_file

    from megatron.training.hf_checkpoints import export_hf

    make, tie, flags = CASES[case]
    hf = tmp_path / "hf"
    make(hf, tie)
    _, out = run_training(2, ["--hf-checkpoint", str(hf), *flags, "--train-iters", "0", "--micro-batch-size", "1",
                              "--global-batch-size", "2", "--eval-interval", "0", "--save", str(tmp_path / "ckpt")],
                          tmp_path, case)
    assert "loaded weights from --hf-checkpoint" in out and "saved checkpoint of iteration 0" in out
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    want, got = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    source = json.load(open(hf / "config.json"))
    exported = json.load(open(tmp_path / "out" / "config.json"))
    assert {k: v for k, v in exported.items() if k != "dtype"} == {k: v for k, v in source.items() if k != "dtype"}
    assert (tmp_path / "out" / "tokenizer.json").exists()
