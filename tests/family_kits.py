"""What the family conformance suite (``tests/test_conformance.py``) needs of each family to test it: how to write a
tiny Hugging Face folder of it, the transformers inputs and logits to compare with, its training data, the pipeline
layouts that cut it where it is interesting, and its tolerances. The checks themselves, and which of them a family
skips, come from the registry (``family_registry``): a kit says how to exercise a family, never what it supports.

A new family joins the suite with one ``Kit`` here (see docs/testing.md).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class Kit:
    """family: its registry name; plugin: the module that registers it (``--family-module``), None for a built-in
    one. make(folder, seed, tie): writes a tiny HF folder (weights and config.json) and returns transformers' model of
    it (None where transformers has none). inputs(): transformers' inputs of ``make``'s models (our logits script
    takes them as they are). make_tuned(folder, seed): a tiny HF folder with its tokenizer for training; returns
    (transformers' model or None, inputs in that tokenizer's ids for a logits check of the trained folder).
    data(folder, data_cache): the trainer's data flags (the data written under ``folder``). pp2: --pipeline-layout
    of its PP2 runs (training; logits too unless ``logits_pp2`` names other cuts, by "untied" / "tied" folder),
    cutting where the family is interesting. run: the flags of its reference
    runs' schedule (the checks add sizes and parallelism). tol / grad_tol: relative, on each iteration's loss and
    gradient norm against the serial run; logits_tol: absolute, on logits against transformers (tuned_logits_tol: on
    the fine-tuned export's, whose weights no seed was picked for). finetune: (iterations,
    ratio): the short fine-tune's length and the most its last five losses' mean may be of its first five's.
    trains_with_projector: name parts of ViT units' tensors that are the projector's (its freezing, its rate)."""

    family: str
    make: Callable
    inputs: Callable[[], dict]
    make_tuned: Callable
    data: Callable[[Path, Path], list[str]]
    pp2: str
    plugin: str | None = None
    run: tuple[str, ...] = ("--lr", "3e-3", "--lr-warmup-iters", "0", "--seed", "5")
    tol: float = 1e-5
    grad_tol: float = 1e-5
    logits_tol: float = 1e-5
    tuned_logits_tol: float | None = None  # on the fine-tuned export's logits (default: logits_tol)
    finetune: tuple[int, float] = (25, 0.7)
    trains_with_projector: tuple[str, ...] = ()  # parameters of ViT units that --freeze-vit leaves training
    logits_pp2: tuple[tuple[str, str], ...] = ()  # (pair, layout) of the PP2 logits checks; default: pp2 on both

    def hf_logits(self, model, batch) -> torch.Tensor:
        """transformers' float32 logits ``[s, vocabulary]`` of ``model`` on ``batch``."""
        with torch.no_grad():
            keys = ("input_ids", "pixel_values") if self.family == "internvl" else tuple(batch)
            return model(**{k: batch[k] for k in keys}).logits[0].float()

    def pp2_logits(self) -> tuple[tuple[str, str], ...]:
        """(folder: "untied" | "tied", --pipeline-layout) of each PP2 logits check."""
        return self.logits_pp2 or (("untied", self.pp2), ("tied", self.pp2))

    def family_flags(self) -> list[str]:
        """What a run of the family needs on its command line beside the folder: its plugin module."""
        return ["--family-module", self.plugin] if self.plugin else []


# ------------------------------------------------------------------------------------------------------- InternVL
def _internvl_make(folder, seed, tie):
    """Untied: LayerNorm ViT with biases, a Qwen2 LLM; tied: RMSNorm ViT with q/k norm, a Llama LLM (head_dim 12); 3
    ViT heads (padded at TP 2)."""
    import hf_tiny

    vit, text = ("rms-qknorm", "llama") if tie else ("ln-bias", "qwen2")
    return hf_tiny.make_tiny(folder, seed=seed, vit=vit, text=text, vit_heads=3)


def _internvl_tuned(folder, seed):
    import hf_tiny

    model, image_id = hf_tiny.make_tiny_with_tokenizer(folder, seed=seed, vit="rms-qknorm", text="qwen2", vit_heads=3)
    return model, hf_tiny.inputs_with_image_id(image_id)


def _digits(folder, data_cache):
    """The built-in digits data (2 tiles at most: short samples)."""
    return ["--max-num-tiles", "2", "--seq-length", "256", "--eval-interval", "0", "--data-cache-dir", str(data_cache)]


def _internvl_inputs():
    import hf_tiny

    return hf_tiny.inputs()


# ----------------------------------------------------------------------------------------------------- Qwen2.5-VL
def _qwen2_5_make(folder, seed, tie):
    import hf_tiny_qwen

    return hf_tiny_qwen.make_tiny(folder, seed=seed, tie=tie)


def _qwen2_5_tuned(folder, seed):
    import hf_tiny_qwen

    model, ids = hf_tiny_qwen.make_tiny_with_tokenizer(folder, seed)
    return model, hf_tiny_qwen.inputs_with_token_ids(ids)


def _qwen2_5_data(folder, data_cache):
    import hf_tiny_qwen

    return ["--data-path", hf_tiny_qwen.write_messages_data(folder), "--max-pixels", str(28 * 28 * 12),
            "--seq-length", "256", "--eval-interval", "0", "--data-cache-dir", str(data_cache)]


def _qwen2_5_inputs():
    import hf_tiny_qwen

    return hf_tiny_qwen.inputs()


# ------------------------------------------------------------------------------------------------------- Qwen3-VL
def _qwen3_vl_make(folder, seed, tie):
    import hf_tiny_qwen3_vl

    return hf_tiny_qwen3_vl.make_tiny(folder, seed=seed, tie=tie)


def _qwen3_vl_tuned(folder, seed):
    import hf_tiny_qwen3_vl

    model, ids = hf_tiny_qwen3_vl.make_tiny_with_tokenizer(folder, seed=seed)
    return model, hf_tiny_qwen3_vl.inputs_with_token_ids(ids)


def _qwen3_vl_data(folder, data_cache):
    """transformers' structured content form (``{"type": "image", "image": PATH}`` parts) with colour images."""
    import hf_tiny_qwen3_vl

    return ["--data-path", hf_tiny_qwen3_vl.write_messages_data(folder, structured_content=True), "--seq-length",
            "256", "--eval-interval", "0", "--data-cache-dir", str(data_cache)]


def _qwen3_vl_inputs():
    import hf_tiny_qwen3_vl

    return hf_tiny_qwen3_vl.inputs()


# -------------------------------------------------------------------------------------------------------- Qwen3.5
QWEN3_5_EPS = 1e-3  # the gated norm's eps of the training runs: see tests/test_qwen3_5_training.py


def _qwen3_5_make(folder, seed, tie):
    import hf_tiny_qwen3_5

    return hf_tiny_qwen3_5.make_tiny(folder, seed=hf_tiny_qwen3_5.SEEDS[tie], tie=tie)


def _qwen3_5_tuned(folder, seed):
    import hf_tiny_qwen3_5
    import hf_tiny_qwen3_vl

    model, ids = hf_tiny_qwen3_5.make_tiny_with_tokenizer(folder, seed=seed, eps=QWEN3_5_EPS)
    return model, hf_tiny_qwen3_vl.inputs_with_token_ids(ids)


def _qwen3_5_data(folder, data_cache):
    import hf_tiny_qwen

    return ["--data-path", hf_tiny_qwen.write_messages_data(folder), "--seq-length", "256", "--eval-interval", "0",
            "--data-cache-dir", str(data_cache)]


def _qwen3_5_inputs():
    import hf_tiny_qwen3_5

    return hf_tiny_qwen3_5.inputs()


# ----------------------------------------------------------------------------------------- the toy family (a plugin)
TOY = "toy-linear-projector"


def _toy_make(folder, seed, tie):
    """The toy's folder as its HF side writes it (``native_config``, the tensors its recipes name, random): no
    transformers model, no tokenizer (the trainer's byte-level one, whose image context id is the config's)."""
    from safetensors.torch import save_file

    import family_registry

    with family_registry.registered(TOY):
        from megatron.vlm.hf.config import HFInfo
        from megatron.vlm.hf.configs import native_config
        from megatron.vlm.hf.keys import recipes
        from omnibal_ext.model.units import get_preset

        spec = get_preset("toy-tiny")
        info = HFInfo(layout="native", text_family="llama", vit_layers_in_checkpoint=spec.vision.num_layers,
                      image_token_id=263)
        _, shapes = recipes(spec, info)
        g = torch.Generator().manual_seed(seed)
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file({name: 0.2 * torch.randn(shape, generator=g) for name, shape in sorted(shapes.items())},
                  str(Path(folder) / "model.safetensors"))
        (Path(folder) / "config.json").write_text(json.dumps(native_config(spec, info, None), indent=1))
    return None


def _toy_tuned(folder, seed):
    return _toy_make(folder, seed, False), None


def _no_inputs():
    return {}


KITS = {kit.family: kit for kit in (
    Kit("internvl", _internvl_make, _internvl_inputs, _internvl_tuned, _digits, pp2="Iv*2P|Et*2L",
        run=("--lr", "2e-3", "--lr-warmup-iters", "0", "--seed", "5"), finetune=(30, 0.8)),
    # logits: the ViT split between a window and the full layers; the tied embedding and head on different stages
    Kit("qwen2_5_vl", _qwen2_5_make, _qwen2_5_inputs, _qwen2_5_tuned, _qwen2_5_data, pp2="Iv*2|v*2PEt*2L",
        logits_pp2=(("untied", "Iv|v*3PEt*2L"), ("tied", "Iv*4PE|t*2L"))),
    # training: DeepStack feature 0 crossing from a ViT stage into a ViT stage; logits: every DeepStack producer and
    # consumer on one stage (the ViT embedding apart; the last LLM layer and the tied head apart)
    # (its DeepStack mergers, in ViT layers, are the projector's)
    Kit("qwen3_vl", _qwen3_vl_make, _qwen3_vl_inputs, _qwen3_vl_tuned, _qwen3_vl_data, pp2="Iv*2|v*2PEt*3L",
        logits_pp2=(("untied", "I|v*4PEt*3L"), ("tied", "Iv*4PEt*2|tL")), trains_with_projector=("deepstack_merger.",)),
    # Qwen3.5: lr 5e-4 and the gated norm's eps 1e-3 keep the oracle's own fp32 noise under 1e-5 on the losses
    # (test_qwen3_5_training.py); its gradient norm at TP2 + SP was measured 1.0e-5 off
    # PP2 logits: the boundary between a linear and a full-attention layer, and between a full and a linear one; the
    # tiny folders' seeds keep transformers' own fp32 noise under 1e-5 (hf_tiny_qwen3_5.SEEDS), a fine-tuned model's
    # up to 1.1e-4 (hf_tiny_qwen3_5.make_tiny)
    Kit("qwen3_5", _qwen3_5_make, _qwen3_5_inputs, _qwen3_5_tuned, _qwen3_5_data, pp2="Iv*2PEt*3|t*2L",
        run=("--lr", "5e-4", "--lr-warmup-iters", "0", "--seed", "5"), grad_tol=3e-5, tuned_logits_tol=1e-4,
        logits_pp2=(("untied", "Iv*2PEt|t*4L"), ("tied", "Iv*2PEt*3|t*2L"))),
    Kit(TOY, _toy_make, _no_inputs, _toy_tuned, _digits, pp2="Iv*4P|Et*4L", plugin="toy_family",
        run=("--lr", "2e-3", "--lr-warmup-iters", "0", "--seed", "5"), finetune=(30, 0.8)),
)}
