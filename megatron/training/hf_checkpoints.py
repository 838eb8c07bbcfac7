"""Hugging Face folders to and from this trainer's checkpoints (``omnibal hf import|export``): an import writes a
checkpoint of ours from a folder read by ``megatron.vlm.hf`` (``HFSource``), an export reads one (merging LoRA
adapters) and writes a native folder with its config.json, safetensors shards and tokenizer. It sits above the
checkpoint module it writes with (``megatron.training.checkpointing``), which ``megatron.vlm.hf`` must not import."""
from __future__ import annotations

import dataclasses
import json
import os
import glob
import shutil

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import FileSystemReader

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import ModelSpec
from omnibal_ext.model.units import spec_from_dict

from megatron.training.checkpointing import (TRACKER, CheckpointError, describe_run, iteration_dir,
                                             read_global_tensors, save_global_tensors)
from megatron.training.checkpointing.lineage import set_aside
from megatron.training.checkpointing.lock import held
from megatron.vlm.hf.config import HFInfo
from megatron.vlm.hf.configs import native_config
from megatron.vlm.hf.convert import DTYPES, HFSource, extra_state_objects, has_tokenizer
from megatron.vlm.hf.keys import recipes, to_hf
from megatron.vlm.layers.lora import merge
from megatron.vlm.stage.components import runtime_family

# what an export copies beside the weights (tokenizer, processors, generation settings)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "preprocessor_config.json", "processor_config.json", "generation_config.json")


def import_hf(folder: str, save: str) -> dict:
    """``omnibal hf import``: in a world of one (process group and megatron's groups already started)."""
    src = HFSource.open(folder)
    tensors = src.global_tensors()
    tokenizer = os.path.abspath(folder) if has_tokenizer(folder) else None
    common = {"run": describe_run(src.spec, tokenizer=tokenizer, hf=src.meta()), "iteration": 0}
    with held(save):  # a writer of the folder, like a training run; its checkpoint starts a new lineage
        moved = set_aside(save, None)
        if moved:
            print(moved, flush=True)
        save_global_tensors(save, tensors, extra_state_objects(src.spec), common, 0)
    return {"spec": src.spec, "tensors": len(tensors), "layout": src.info.layout}


def export_hf(load: str, out: str, step: int | None = None, dtype: str | None = None,
              max_shard_bytes: int = 4 << 30) -> dict:
    """``omnibal hf export``: any checkpoint of ours -> a native HF folder. Needs no process group."""
    _check_out_folder(out)
    if step is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            raise CheckpointError(f"--load {load}: no {TRACKER} there (not a checkpoint folder of ours)")
        step = int(open(tracker).read().strip())
    path = iteration_dir(load, step)
    common = dist_checkpointing.load_common_state_dict(path)
    run = common.get("run") or {}
    meta = run.get("hf")
    if not meta:
        raise CheckpointError(f"--load {load}: iteration {step} was not trained from a Hugging Face model (its run "
                              "description holds no 'hf' entry: import with `omnibal hf import` or train with "
                              "--hf-checkpoint)")
    spec = spec_from_dict(run["model"])
    info = HFInfo.from_dict(meta["info"])
    if info.image_token_id is None:  # an original-layout config names none: the tokenizer's context token is it
        info = dataclasses.replace(info, image_token_id=tokenizer_image_token_id(
            spec, load, run.get("tokenizer"), meta.get("source")))
    native = dataclasses.replace(info, layout="native",
                                 text_family="llama" if info.text_family == "internlm2" else info.text_family)
    style = meta.get("style", "legacy") if info.layout == "native" else "legacy"
    table, _ = recipes(spec, native, style)
    tensors = read_global_tensors(path, [k for k in table if not (spec.language.tie_word_embeddings
                                                                  and k == "llm.head.output.weight")])
    if run.get("lora"):
        merge_adapters(path, tensors, float(run["lora"]["scaling"]))
    if spec.language.tie_word_embeddings:
        tensors["llm.head.output.weight"] = tensors["llm.embed.word.weight"]
    torch_dtype = DTYPES[dtype or meta.get("dtype") or "float32"]
    hf = to_hf(spec, native, tensors, style, dtype=torch_dtype)
    os.makedirs(out, exist_ok=True)
    config = native_config(spec, info, meta.get("config"))
    config["dtype"] = {v: k for k, v in DTYPES.items()}[torch_dtype]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    files = write_safetensors(hf, out, max_shard_bytes)
    copied = copy_tokenizer(out, run.get("tokenizer"), meta.get("source"))
    return {"iteration": step, "tensors": len(hf), "files": files, "tokenizer": copied}


def _check_out_folder(out: str) -> None:
    """``--out`` must be (or be creatable as) a folder: a file on the path is refused before any reading."""
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise UserError(f"--out {out}: {path} is a file, not a folder: give a folder to write the Hugging Face "
                        "model into")


def tokenizer_image_token_id(spec: ModelSpec, load: str, *folders) -> int:
    """The image-context token's id (the family's third ``DataSide.image_tokens`` string) in the
    tokenizer of the first of ``folders`` that holds one (the training's, then the imported folder), for a config.json
    that needs ``image_token_id`` where the imported one named none; refused, naming what is missing, when no folder
    holds a tokenizer, its vocabulary lacks the token, or the id is past the model's vocabulary."""
    from transformers import AutoTokenizer  # optional: the hf extra

    token = runtime_family(spec).data.image_tokens[2]
    folder = next((f for f in folders if f and os.path.isdir(f) and has_tokenizer(f)), None)
    if folder is None:
        raise UserError(f"--load {load}: the imported config.json names no image_token_id and no tokenizer folder "
                        f"is known (tried: {', '.join(f for f in folders if f) or 'none recorded'}) to take "
                        f"{token}'s id from; transformers refuses a config without it: put the model's tokenizer "
                        "files beside its config.json and import again, or train with --tokenizer-model")
    tid = AutoTokenizer.from_pretrained(folder).get_vocab().get(token)
    if tid is None:
        raise UserError(f"--load {load}: the imported config.json names no image_token_id and the tokenizer of "
                        f"{folder} has no {token} token to take it from")
    if not 0 <= tid < spec.language.vocab_real:
        raise UserError(f"--load {load}: {token} is id {tid} in the tokenizer of {folder}, past the model's "
                        f"{spec.language.vocab_real}-token vocabulary")
    return int(tid)


def merge_adapters(path: str, tensors: dict[str, torch.Tensor], scaling: float) -> int:
    """Merge the LoRA adapters the checkpoint ``path`` holds beside any of ``tensors``' weights into them (in place);
    returns how many weights took adapters."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    pairs = {k: (k[:-len("weight")] + "lora_a", k[:-len("weight")] + "lora_b") for k in tensors
             if k.endswith(".weight") and k[:-len("weight")] + "lora_a" in saved}
    adapters = read_global_tensors(path, [name for pair in pairs.values() for name in pair])
    for key, (a, b) in pairs.items():
        tensors[key] = merge(tensors[key], adapters[a], adapters[b], scaling)
    return len(pairs)


def write_safetensors(tensors: dict[str, torch.Tensor], out: str, max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file  # optional (the hf extra): only HF folders need it

    for old in glob.glob(os.path.join(out, "*.safetensors")) + glob.glob(os.path.join(out, "*.safetensors.index.json")):
        os.remove(old)
    shards, size = [[]], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        save_file({n: tensors[n].contiguous() for n in shards[0]}, os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, os.path.join(out, fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


def copy_tokenizer(out: str, *folders) -> str | None:
    """Copy the tokenizer files of the first of ``folders`` that holds a tokenizer; returns that folder."""
    for folder in folders:
        if folder and os.path.isdir(folder) and has_tokenizer(folder):
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(folder, name)):
                    shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
            return folder
    return None
