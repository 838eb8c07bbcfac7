"""The checks every Hugging Face family's tests make against transformers, written once:

* ``torchrun_logits``: our logits of tiny HF folders from ``scripts/hf_logits.py``'s ``main``, each (folder, layout)
  case in the worker pool of its world size (``tests/pool.py``; ``logits_by_layout``: one folder at named layouts);
  the caller compares them with its own oracle (transformers' logits) at its own tolerance;
* ``import_export`` / ``assert_same_tensors`` / ``assert_transformers_loads_the_same``: the import -> export
  round trip bit-identical, and transformers loading the export to the source model's logits (in a worker-pool case,
  outside this process: the CPU patches of ``megatron.training.cpu_compat`` spoil the rotary buffers transformers
  recomputes in ``from_pretrained``, and a pool's case runs without them);
* ``untied_and_tied``: a module fixture's two tiny checkpoints;
* ``eager``: transformers' eager attention in a Qwen-style model (the reference for 1e-5 comparisons);
* ``write_char_tokenizer`` / ``write_qwen_preprocessor``: a tiny folder's tokenizer and image processor files.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def untied_and_tied(tmp_path_factory, make_tiny, seeds: tuple[int, int] = (0, 1)) -> dict:
    """{"untied"|"tied": (folder, transformers model)}: ``make_tiny(folder, seed=..., tie=...)`` (``seeds``: the
    untied one's, the tied one's) in new temporary folders (a module fixture's pair of tiny checkpoints)."""
    out = {}
    for seed, tie in zip(seeds, (False, True)):
        name = "tied" if tie else "untied"
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, make_tiny(folder, seed=seed, tie=tie))
    return out


def torchrun_logits(cases: Sequence[tuple[Path | str, Sequence[str]]], batch: dict | Sequence[dict], workdir: Path,
                    nproc: int = 2, timeout: int = 600) -> list[torch.Tensor]:
    """Our float32 logits ``[s, real vocabulary]`` on ``batch`` (transformers' inputs, see scripts/hf_logits.py; or
    one batch per case) of each case ``(HF folder, hf_logits.py flags)`` (``--tensor-model-parallel-size 2``,
    ``--pipeline-layout ...``), in order: scripts/hf_logits.py's ``main`` for every case in the worker pool of
    ``nproc`` ranks (asserting each succeeds). ``workdir``: where the inputs and the outputs are written."""
    import pool

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    batches = [batch] * len(cases) if isinstance(batch, dict) else list(batch)
    assert len(batches) == len(cases), (len(batches), len(cases))
    out = []
    for k, ((folder, flags), one) in enumerate(zip(cases, batches)):
        torch.save(one, workdir / f"in{k}.pt")
        argv = ["--hf-checkpoint", str(folder), "--inputs", str(workdir / f"in{k}.pt"), "--out",
                str(workdir / f"out{k}.pt"), *flags]
        run = pool.run_case("hf_logits:main", argv, nproc, workdir, timeout=timeout)
        assert run.returncode == 0, f"hf_logits {' '.join(argv)}:\n{run.output[-6000:]}"
        out.append(torch.load(workdir / f"out{k}.pt"))
    return out


def logits_by_layout(folder: Path | str, batch: dict, workdir: Path,
                     layouts: dict[str, tuple[int, Sequence[str]]]) -> dict[str, torch.Tensor]:
    """``torchrun_logits`` of one HF ``folder`` at each of ``layouts`` (name: (world size, hf_logits.py flags)), each in
    the pool of its world size; returns the logits by layout name."""
    return {name: torchrun_logits([(folder, flags)], batch, Path(workdir) / name, nproc)[0]
            for name, (nproc, flags) in layouts.items()}


def import_export(folder: Path | str, workdir: Path) -> Path:
    """``import_hf`` of the HF ``folder`` into ``workdir/ckpt``, then ``export_hf`` of that into ``workdir/out``
    (inside a world of one: the caller's ``megatron_world``); returns the export's folder."""
    from megatron.training.hf_checkpoints import export_hf, import_hf

    workdir = Path(workdir)
    import_hf(str(folder), str(workdir / "ckpt"))
    export_hf(str(workdir / "ckpt"), str(workdir / "out"))
    return workdir / "out"


def assert_round_trips(folders: dict, workdir: Path) -> list[tuple[Path, Path]]:
    """Each named HF folder of ``folders`` (name -> folder) through ``import_export``: the export holds the same
    tensors bit for bit and the same config.json (its dtype float32); returns the (source, export) pairs for
    ``assert_transformers_loads_the_same``."""
    pairs = []
    for name, folder in folders.items():
        out = import_export(folder, Path(workdir) / name)
        assert_same_tensors(folder, out, name)
        assert config_of(out) == {**config_of(folder), "dtype": "float32"}, name
        pairs.append((Path(folder), out))
    return pairs


def assert_same_tensors(want: Path | str, got: Path | str, what="") -> None:
    """The ``model.safetensors`` of folders ``want`` and ``got`` hold the same names, dtypes and bits."""
    from safetensors.torch import load_file

    a, b = load_file(str(Path(want) / "model.safetensors")), load_file(str(Path(got) / "model.safetensors"))
    assert set(a) == set(b), (what, sorted(set(a) ^ set(b))[:8])
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)


def config_of(folder: Path | str) -> dict:
    """``folder``'s config.json."""
    return json.loads((Path(folder) / "config.json").read_text())


def assert_transformers_loads_the_same(model_class: str, pairs: Sequence[tuple[Path | str, Path | str]],
                                       batch: dict, workdir: Path, timeout: int = 300) -> None:
    """transformers' ``model_class`` (a name in ``transformers``) loads both folders of each pair (eager attention)
    and gives bit-identical logits on ``batch``; a case of the worker pool of one rank (``loads_the_same``: outside
    the CPU patches, see the module docstring)."""
    import pool

    torch.save(batch, Path(workdir) / "loads_in.pt")
    folders = [str(f) for pair in pairs for f in pair]
    run = pool.run_case("hf_check:loads_the_same", [model_class, str(Path(workdir) / "loads_in.pt"), *folders], 1,
                        workdir, timeout=timeout)
    assert run.returncode == 0 and "same" in run.output, run.output[-3000:]


def loads_the_same(argv: list[str]) -> int:
    """``MODEL_CLASS BATCH.pt SOURCE EXPORT [SOURCE EXPORT ...]``: transformers' logits of each pair's folders on the
    batch are bit-identical (an AssertionError naming the export otherwise); prints "same"."""
    import transformers

    model_class, batch = getattr(transformers, argv[0]), torch.load(argv[1])
    for a, b in zip(argv[2::2], argv[3::2]):
        x, y = (model_class.from_pretrained(f, attn_implementation="eager").eval() for f in (a, b))
        with torch.no_grad():
            assert torch.equal(x(**batch).logits, y(**batch).logits), b
    print("same", flush=True)
    return 0


def eager(model):
    """``model`` (a Qwen-style ``...ForConditionalGeneration``: ``model.model.visual``, ``.language_model``) with
    transformers' eager attention in all its parts (the reference for 1e-5 comparisons)."""
    for config in (model.config, model.model.visual.config, model.model.language_model.config):
        config._attn_implementation = "eager"
    return model


CHARS = ["\n"] + [chr(c) for c in range(32, 127)]  # the character tokenizer's ordinary tokens


def write_char_tokenizer(folder: Path, specials: Sequence[str], chat_template: str, pad_token: str,
                         eos_token: str, unk_token: str = "<unk>") -> dict[str, int]:
    """A character-level WordLevel tokenizer (``tokenizer.json``, ``tokenizer_config.json``) in ``folder``: ids 0..
    for ``specials`` (special tokens), then one per printable ASCII character and newline; ``chat_template``
    (Jinja) as its chat template. Returns the special tokens' ids by name."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*specials, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk_token))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(list(specials))
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": pad_token, "unk_token": unk_token,
        "eos_token": eos_token, "chat_template": chat_template, "extra_special_tokens": {}}))
    return {t: vocab[t] for t in specials}


def write_qwen_preprocessor(folder: Path, patch: int, min_pixels: int, max_pixels: int) -> None:
    """A Qwen-VL ``preprocessor_config.json`` (Qwen2VLImageProcessorFast: merge 2, temporal patch 2, mean/std 0.5)
    of ``patch`` px patches and a pixel budget of ``min_pixels`` .. ``max_pixels`` px per image."""
    (Path(folder) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": patch, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}))
