"""Tiny HF folders of every family made for generation tests, their requests, and transformers' ``generate`` on them
(the oracle of tests/test_generate*.py and scripts/bench_generate.py).

* ``make_family(name, folder)``: the family's tiny random model (``tests/hf_tiny*.py``, with its tokenizer and chat
  template, image and video processor files) with weights that make continuations vary: a random tiny model tends
  to repeat one token, which would hide KV-cache or position errors, so the LLM's q/k projections and the token
  embedding are scaled (``VARY``) before the folder is saved;
* ``write_requests(folder)``: an image, an H.264 video and three ``messages`` requests of different lengths (image,
  video, text only) as a JSONL;
* ``read_prompts`` / ``hf_inputs``: our reader's prompts and transformers' inputs made of them (token ids, pixel rows,
  grids: the videos' as the model classes take them, their video processors needing torchvision);
  ``processor_inputs``: an image request through transformers' processor (the tokenizer's chat template and
  ``Qwen2VLImageProcessorPil``), which tests compare with ours;
* ``hf_greedy``: transformers' ``generate`` (greedy, fp32, eager): the new tokens, each step's logits and top-1 /
  top-2 gap;
* ``compare``: the acceptance's equality of our tokens with transformers' up to its first near-tie (gap < tau, tau =
  max(1e-4, 4 x the measured max |delta logit|)), and of our argmax where teacher-forced with its tokens wherever the
  gap is at least tau.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

import pool

NEW_TOKENS = 32
VARY = 2.5  # the LLM's q/k projections (and norms) and the token embedding are scaled by this (varied continuations)
FRAMES, FPS, VIDEO_W, VIDEO_H = 6, 4, 64, 48
QWEN_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
FAMILIES = ("internvl", "internvl3_5", "internvl3_5_moe", *QWEN_FAMILIES)
MOE = ("internvl3_5_moe", "qwen3_vl_moe", "qwen3_5_moe")
# layouts with the ViT split over the two stages (PP 2)
VIT_SPLIT = {"internvl": "Iv|vPEt*2L", "internvl3_5": "Iv|vPEt*2L", "internvl3_5_moe": "Iv|vPEt*2L",
             "qwen2_5_vl": "Iv*2|v*2PEt*2L", "qwen3_vl": "Iv*2|v*2PEt*3L", "qwen3_vl_moe": "Iv*2|v*2PEt*3L",
             "qwen3_5": "Iv|vPEt*5L", "qwen3_5_moe": "Iv|vPEt*5L"}
REQUESTS = ({"messages": [{"role": "user", "content": "<image>What is in the picture?"}], "images": ["a.png"]},
            {"messages": [{"role": "user", "content": "<video>Describe the clip."}], "videos": ["v.mp4"]},
            {"messages": [{"role": "user", "content": "Count from one to ten, please, and then say why."}]})


def make_family(name: str, folder: Path, seed: int = 0):
    """A new tiny HF folder of family ``name`` (module docstring); returns its transformers model (eval, fp32,
    eager)."""
    import hf_tiny
    import hf_tiny_qwen
    import hf_tiny_qwen3_5 as q35
    import hf_tiny_qwen3_5_moe as q35m
    import hf_tiny_qwen3_vl as q3
    from hf_check import eager, write_qwen_preprocessor

    folder = Path(folder)
    if name.startswith("internvl"):
        text = {"internvl": "qwen2", "internvl3_5": "qwen3", "internvl3_5_moe": "qwen3_moe"}[name]
        model, _ = hf_tiny.make_tiny_with_tokenizer(folder, seed=seed, text=text)
    elif name == "qwen2_5_vl":
        model, _ = hf_tiny_qwen.make_tiny_with_tokenizer(
            folder, seed, write_preprocessor=lambda f: write_qwen_preprocessor(f, 14, 28 * 28, 28 * 28 * 12))
    elif name == "qwen3_vl":
        model, _ = q3.make_tiny_with_tokenizer(folder, seed)
    elif name == "qwen3_vl_moe":
        model, _ = hf_tiny_qwen.make_tiny_with_tokenizer(folder, seed, q3.make_tiny_moe, q3.write_preprocessor)
    elif name == "qwen3_5":
        model, _ = q35.make_tiny_with_tokenizer(folder, q35.SEEDS[0])
    elif name == "qwen3_5_moe":
        model, _ = q35m.make_tiny_moe_with_tokenizer(folder, seed)
    else:
        raise ValueError(f"make_family: unknown family {name!r}")
    vary(model)
    model.save_pretrained(str(folder))
    if name in QWEN_FAMILIES:
        patch = 14 if name == "qwen2_5_vl" else 16
        (folder / "video_preprocessor_config.json").write_text(json.dumps(
            {"size": {"shortest_edge": 4 * patch * patch, "longest_edge": 16 * patch * patch}, "patch_size": patch}))
    return eager(model) if name in QWEN_FAMILIES else model.eval()


def vary(model) -> None:
    """Scale the LLM's q/k projections and its token embedding by ``VARY`` (in place; the head untied from it)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name or "visual" in name:
                continue
            if name.endswith(("q_proj.weight", "k_proj.weight", "embed_tokens.weight", "q_norm.weight",
                              "k_norm.weight")):  # Qwen3's q/k norms: the projections' scale is normalised away
                p.mul_(VARY)


def write_requests(folder: Path) -> Path:
    """``a.png`` (56 x 84 px), ``v.mp4`` (``FRAMES`` frames at ``FPS``) and ``requests.jsonl`` (``REQUESTS``) in
    ``folder``; returns the JSONL's path."""
    from PIL import Image

    from megatron.vlm.data.video_synthetic import write_coded_video

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:56, 0:84]
    pixels = np.stack([120 + 100 * np.sin(x / 9), 120 + 100 * np.cos(y / 7), 60 + 0 * x], -1) + rng.normal(0, 20, (56, 84, 3))
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / "a.png")
    write_coded_video(str(folder / "v.mp4"), FRAMES, FPS, VIDEO_W, VIDEO_H)
    path = folder / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    return path


def reader_args(**kw):
    """The trainer's image and video flags (``MediaOverrides``) at their defaults but 2 tiles per image, with ``kw``
    (``video_max_frames=4``: ``--video-max-frames 4``)."""
    from megatron.vlm.data.images import MediaOverrides
    from megatron.vlm.data.video_sampling import VideoOverrides

    base = dict(min_pixels=None, max_pixels=None, max_num_tiles=2, min_num_tiles=1, video_fps=None,
                video_min_frames=None, video_max_frames=None, video_max_pixels=None, video_total_pixels=None,
                video_folder_fps=None)
    flags = SimpleNamespace(**{**base, **kw})
    return MediaOverrides(max_num_tiles=flags.max_num_tiles, min_num_tiles=flags.min_num_tiles,
                          min_pixels=flags.min_pixels, max_pixels=flags.max_pixels,
                          video=VideoOverrides.from_args(flags))


def trainer_flags(name: str) -> list[str]:
    """The trainer flags the reader settings of ``reader_args`` need for ``name`` (InternVL: 4 frames a video)."""
    return ["--video-max-frames", "4", "--max-num-tiles", "2"] if name.startswith("internvl") else []


def family_reader_args(name: str):
    from megatron.vlm.data.video_sampling import DEFAULT_FOLDER_FPS

    if name.startswith("internvl"):
        return reader_args(video_max_frames=4, video_folder_fps=DEFAULT_FOLDER_FPS)
    return reader_args(max_num_tiles=12, video_folder_fps=DEFAULT_FOLDER_FPS)


def read_prompts(name: str, folder: Path, requests: Path):
    """(our reader's prompts of ``requests`` for the HF ``folder``, the tokenizer, the image rule)."""
    from megatron.vlm.data.tokenizer import build_tokenizer
    from megatron.vlm.stage.components import runtime_family
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.inference.build import reader_config
    from megatron.vlm.inference.prompts import read_prompts as read

    spec = HFSource.open(str(folder), check=False).spec
    tokenizer = build_tokenizer(str(folder), image_tokens=runtime_family(spec).data.image_tokens)
    config = reader_config(family_reader_args(name), spec, str(folder))
    lines = Path(requests).read_text().splitlines()
    prompts = read(lines, str(Path(requests).parent), tokenizer, config, [f"{requests}:{i + 1}" for i in range(len(lines))])
    return prompts, tokenizer, config.images


def hf_inputs(name: str, sample: dict, rule, model) -> dict:
    """transformers' inputs of one prompt (our reader's sample): token ids, and the pixel rows with the grids as the
    model class takes them (Qwen: images' ``image_grid_thw``, a video's ``video_grid_thw`` (its temporal patches
    together) and Qwen2.5-VL's ``second_per_grid_ts``, ``mm_token_type_ids``)."""
    ids = torch.as_tensor(sample["input_ids"]).unsqueeze(0)
    if name.startswith("internvl"):
        out = {"input_ids": ids}
        if int(sample["image_flags"].sum()) > 0:
            out["pixel_values"] = sample["pixel_values"]
        return out
    types = torch.as_tensor(sample.get("mm_token_type_ids", (ids[0] == model.config.image_token_id).long()))
    out = {"input_ids": ids, "mm_token_type_ids": types.reshape(1, -1)}
    blocks = sample.get("video_blocks") or [None] * len(sample["image_sizes"])
    rows = sample["pixel_values"]
    images, videos, at = [], [], 0
    for k, block in enumerate(blocks):
        grid = rule.grid(*(int(v) for v in sample["image_sizes"][k])) if block is None else tuple(block.grid_thw)
        n = grid[0] * grid[1] * grid[2]
        part = rows[at:at + n]
        at += n
        if block is None:
            images.append((grid, part))
        elif block.first or not videos:
            videos.append([list(grid), part, block.second_per_grid_ts])
        else:  # Qwen3-VL: another temporal patch of the same video
            videos[-1][0][0] += grid[0]
            videos[-1][1] = torch.cat([videos[-1][1], part])
    if images:
        out["pixel_values"] = torch.cat([p for _, p in images])
        out["image_grid_thw"] = torch.tensor([g for g, _ in images])
    if videos:
        out["pixel_values_videos"] = torch.cat([p for _, p, _ in videos])
        out["video_grid_thw"] = torch.tensor([g for g, _, _ in videos])
        if name == "qwen2_5_vl":
            out["second_per_grid_ts"] = torch.tensor([s for _, _, s in videos])
    return out


def processor_inputs(name: str, folder: Path, request: dict, root: Path) -> dict:
    """An image request through transformers' processor: the tokenizer's chat template (with the generation prompt)
    and ``Qwen2VLImageProcessorPil`` of the folder's pixel budget (Qwen families)."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    config = json.loads((Path(folder) / "preprocessor_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    cls = Qwen2_5_VLProcessor if name == "qwen2_5_vl" else Qwen3VLProcessor

    class ImagesOnly(cls):  # no video processor (it needs torchvision)
        def check_argument_for_proper_class(self, attribute, arg):
            return None if attribute == "video_processor" and arg is None else super().check_argument_for_proper_class(
                attribute, arg)

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=config["patch_size"], merge_size=config["merge_size"], temporal_patch_size=2,
        image_mean=config["image_mean"], image_std=config["image_std"],
        min_pixels=config["size"]["shortest_edge"], max_pixels=config["size"]["longest_edge"])
    processor = ImagesOnly(image_processor=image_processor, tokenizer=tokenizer)
    text = request["messages"][0]["content"].replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
    image = Image.open(Path(root) / request["images"][0]).convert("RGB")
    out = processor(text=[prompt], images=[image], return_tensors="pt")
    return {k: out[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids") if k in out}


@dataclass(frozen=True)
class Greedy:
    """transformers' greedy continuation: the new tokens, each step's logits [steps, V] fp32 and top-1/top-2 gap."""

    tokens: list[int]
    logits: torch.Tensor
    gaps: list[float]


def hf_greedy(model, inputs: dict, new_tokens: int = NEW_TOKENS) -> Greedy:
    """transformers' ``generate`` (greedy, no end token: ``new_tokens`` tokens) on ``inputs``."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logits = torch.stack([step[0].float() for step in out.logits])
    top = torch.topk(logits, 2, dim=-1).values
    return Greedy(tokens, logits, (top[:, 0] - top[:, 1]).tolist())


@dataclass(frozen=True)
class Verdict:
    """One prompt's comparison: tau, the first near-tie step (None: none in the 32), the steps checked."""

    tau: float
    max_dlogit: float
    near_tie: int | None
    greedy_equal_steps: int
    forced_checked: int


def compare(ours_tokens: list[int], forced_argmax: list[int], forced_logits: torch.Tensor, hf: Greedy,
            what: str = "") -> Verdict:
    """The acceptance's equality (module docstring); raises AssertionError naming ``what`` and the step."""
    vocab = min(forced_logits.shape[-1], hf.logits.shape[-1])
    dlogit = float((forced_logits[:, :vocab] - hf.logits[:, :vocab]).abs().max())
    tau = max(1e-4, 4 * dlogit)
    ties = [k for k, gap in enumerate(hf.gaps) if gap < tau]
    first = ties[0] if ties else None
    upto = len(hf.tokens) if first is None else first
    assert ours_tokens[:upto] == hf.tokens[:upto], (what, "greedy tokens differ before the first near-tie", first,
                                                   ours_tokens, hf.tokens)
    checked = 0
    for k, (mine, theirs, gap) in enumerate(zip(forced_argmax, hf.tokens, hf.gaps)):
        if gap >= tau:
            assert mine == theirs, (what, f"teacher-forced argmax differs at step {k} (gap {gap:.2e} >= tau {tau:.2e})")
            checked += 1
    return Verdict(tau, dlogit, first, upto, checked)


@dataclass(frozen=True)
class Case:
    """One engine run of ``tests/generate_worker.py``: its name, the trainer's flags, the requests JSONL, the
    sampling settings (``SamplingParams`` fields) and the tokens to feed back per request (None: none)."""

    name: str
    flags: tuple[str, ...]
    requests: Path
    sampling: dict
    forced: list[list[int]] | None = None


def generate_in_pool(cases: list[Case], workdir: Path, nproc: int = 2, timeout: int = 1200) -> dict[str, dict]:
    """Every case in one run of ``tests/generate_worker.py`` on the worker pool of ``nproc`` ranks (asserting it
    succeeds); the worker's outputs by case name."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    specs = []
    for k, case in enumerate(cases):
        forced = None
        if case.forced is not None:
            forced = str(workdir / f"forced{k}.pt")
            torch.save(case.forced, forced)
        specs.append({"flags": list(case.flags), "requests": str(case.requests), "sampling": case.sampling,
                      "forced": forced, "out": str(workdir / f"out{k}.pt")})
    (workdir / "cases.json").write_text(json.dumps(specs))
    run = pool.run_case("generate_worker:main", [str(workdir / "cases.json")], nproc, workdir, timeout=timeout)
    assert run.returncode == 0, run.output[-8000:]
    return {case.name: torch.load(workdir / f"out{k}.pt") for k, case in enumerate(cases)}
