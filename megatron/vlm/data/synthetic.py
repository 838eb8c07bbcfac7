"""A synthetic dataset (meta JSON, ``conversations`` records) whose per-sample load follows real OmniBal stats files.

The OmniBal stats files (``data/omnibal_stats/*.json.gz``) give, per real sample, the ViT
tiles ``vit_num`` and the LLM length ``token_num`` (image tokens included, ``tokens_per_tile_real`` =
256 per tile).  ``build_stats_matched_dataset`` draws records from them (seeded) and writes a dataset
the trainer reads like any other, in which sample ``i`` built from record ``(k, n)`` has

* exactly ``k`` ViT tiles: ``k`` square single-tile images of ``tile_size`` px (a square image of
  one tile side is a 1x1 grid under dynamic tiling, whatever ``--max-num-tiles`` and the
  multi-image tile split are, and gets no thumbnail); ``k == 0`` gives a text-only sample (the
  reader then feeds one dummy tile);
* exactly ``intended_tokens(k, n) = k * tokens_per_tile_model + text(k, n)`` LLM tokens with the
  byte tokenizer (1 token per byte), where the non-image part is scaled (and, with ``max_tokens``,
  cut so that the sample stays within ``max_tokens``):
  ``text(k, n) = max(min(round(text_scale * max(n - tokens_per_tile_real * k, 0)),
  max_tokens - k * tokens_per_tile_model), min_text_tokens(k))``.
  The text part counts everything that is not an image-context token (chat template, ``<img>`` /
  ``</img>`` markers, question and answer), as ``token_num - 256 k`` does for the real data.
  ``min_text_tokens(k)`` is the template with ``k`` image blocks and a one-byte answer
  (``22 + 3 k`` bytes with the byte tokenizer): shorter texts are raised to it.

Choice of ``text_scale`` (default ``DEFAULT_TEXT_SCALE`` = 1.0): the tiny CPU models run
``tokens_per_tile_model`` = 4 image tokens per 32 px tile instead of 256, so the LLM sequences
already shrink to the real non-image text (median 65 tokens, 99th percentile 720 on the three shipped
sets) plus a few image tokens: mean about 143 tokens, longest about 1280 -- CPU-sized.  Scaling the
text down further distorts the distribution: the byte-level template alone is 22 + 3 k tokens, so
at 0.5 about 46 % of the samples (0.25: 74 %) would be raised to the minimum, against 0.7 % at 1.0.
Give the trainer ``--seq-length`` >= ``max_intended_tokens(...)``.  ``max_tokens`` cuts the long
tail (benchmarks: 512, 3.6 % of the samples): ISF's token cap must hold the longest sample, so one
1280-token sample would force packs of ~9 samples where 4 are wanted.

Layout of ``out_dir`` (paths in the meta relative to it)::

    images/pool_NN.png      a pool of square noise images (samples reference them; pixels do not matter)
    train.jsonl             one record per sample: id, image list, conversations, and the stats record
                            it was drawn from ({"stats_file", "stats_index" (into the concatenated
                            files), "vit_num", "token_num"})
    meta_train.json         {"synthetic_stats": {"root": ".", "annotation": "train.jsonl", "length": N}}
    .complete.json          marker with the build parameters (written last)

Idempotent like ``digits.build_digits_dataset``: a complete build with the same parameters is reused,
another one in the folder is an error, and the build goes to a temporary sibling renamed into place.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from omnibal_ext.data.stats import load_stats

from .digits import MARKER, _save, build_once
from .tiling import count_tiles

FORMAT_VERSION = 1
DEFAULT_TEXT_SCALE = 1.0
POOL_IMAGES = 16
TEMPLATE_TOKENS = 22  # <s>, <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n ... <|im_end|>\n (byte tokenizer)
PER_IMAGE_TEXT_TOKENS = 3  # <img>, </img> and the "\n" after each image placeholder
_FILLER = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)


@dataclass(frozen=True)
class LengthRule:
    """How a stats record (``vit_num`` k, ``token_num`` n) maps to a synthetic sample (tiles, tokens)."""

    tokens_per_tile_real: int = 256  # image tokens per tile in the stats' token_num
    tokens_per_tile_model: int = 4  # image-context tokens per tile of the model trained here
    text_scale: float = DEFAULT_TEXT_SCALE  # factor on the non-image tokens
    max_tokens: int | None = None  # longest sample allowed (tokens): longer texts are cut; None = no cut

    def __post_init__(self):
        if self.tokens_per_tile_real < 0 or self.tokens_per_tile_model < 1 or not self.text_scale > 0:
            raise ValueError(f"LengthRule: need tokens_per_tile_real >= 0, tokens_per_tile_model >= 1 and "
                             f"text_scale > 0, got {self}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"LengthRule: max_tokens must be >= 1 or None, got {self.max_tokens}")

    @staticmethod
    def min_text_tokens(k: np.ndarray | int) -> np.ndarray | int:
        """Non-image tokens of the shortest sample with ``k`` images: template + markers + 1-byte answer."""
        return TEMPLATE_TOKENS + PER_IMAGE_TEXT_TOKENS * k + 1

    def text_tokens(self, vit_num, token_num) -> np.ndarray:
        """int64: the non-image tokens of each synthetic sample (see the module docstring)."""
        k, n = np.asarray(vit_num, np.int64), np.asarray(token_num, np.int64)
        real_text = np.maximum(n - self.tokens_per_tile_real * k, 0)
        text = np.rint(self.text_scale * real_text).astype(np.int64)
        if self.max_tokens is not None:
            text = np.minimum(text, self.max_tokens - k * self.tokens_per_tile_model)
        return np.maximum(text, self.min_text_tokens(k))

    def tokens(self, vit_num, token_num) -> np.ndarray:
        """int64: LLM tokens of each synthetic sample."""
        return np.asarray(vit_num, np.int64) * self.tokens_per_tile_model + self.text_tokens(vit_num, token_num)

    def tiles(self, vit_num) -> np.ndarray:
        """int64: ViT tiles the reader feeds per sample (a text-only sample gets one dummy tile)."""
        return np.maximum(np.asarray(vit_num, np.int64), 1)


def draw_records(num_records: int, num_samples: int, seed: int) -> np.ndarray:
    """Indices of the stats records the samples are built from: a seeded permutation of all records,
    repeated (a new permutation per pass) when more samples than records are asked.  Prefix-stable:
    the first N indices are the same for any ``num_samples >= N``."""
    if num_records < 1 or num_samples < 1:
        raise ValueError(f"draw_records: need records and samples >= 1, got {num_records}, {num_samples}")
    passes = -(-num_samples // num_records)
    parts = [np.random.default_rng([seed, p]).permutation(num_records) for p in range(passes)]
    return np.concatenate(parts)[:num_samples].astype(np.int64)


def load_stats_records(stats_files) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(vit_num, token_num, file index, files) of every record of ``stats_files``, in order."""

    files = [str(f) for f in stats_files]
    if not files:
        raise ValueError("build_stats_matched_dataset: no stats files given")
    stats = load_stats(files)  # StatsError (a ValueError) names the file and record on bad input
    return stats.vit, stats.tokens, stats.source, files


def sample_plan(stats_files, num_samples: int, rule: LengthRule, seed: int = 0) -> dict:
    """What the dataset will hold, without writing it: per sample the drawn record and its intended
    tiles and tokens (int64 arrays ``record``, ``file``, ``vit_num``, ``token_num``, ``tiles``,
    ``tokens``).  Benchmarks use it to size runs before building."""
    vit, tok, src, files = load_stats_records(stats_files)
    rec = draw_records(len(vit), num_samples, seed)
    return {"files": files, "record": rec, "file": src[rec].astype(np.int64), "vit_num": vit[rec],
            "token_num": tok[rec], "tiles": rule.tiles(vit[rec]), "tokens": rule.tokens(vit[rec], tok[rec])}


def max_intended_tokens(stats_files, num_samples: int, rule: LengthRule, seed: int = 0) -> int:
    """The longest synthetic sample, tokens (the trainer's ``--seq-length`` must be at least this)."""
    return int(sample_plan(stats_files, num_samples, rule, seed)["tokens"].max())


def _files_digest(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:16]


def build_stats_matched_dataset(stats_files, out_dir: str, num_samples: int, tile_size: int,
                                tokens_per_tile_real: int = 256, tokens_per_tile_model: int = 4,
                                text_scale: float = DEFAULT_TEXT_SCALE, seed: int = 0,
                                max_tokens: int | None = None) -> str:
    """Write the stats-matched dataset into ``out_dir`` (if not already there); returns its meta path.

    ``tile_size``: the model's tile side in px (``--image-size``); ``tokens_per_tile_model``: its
    image-context tokens per tile (``ModelSpec.tokens_per_tile``).  See the module docstring for the
    length rule and the folder layout.
    """
    rule = LengthRule(tokens_per_tile_real, tokens_per_tile_model, text_scale, max_tokens)
    if num_samples < 1 or tile_size < 1:
        raise ValueError(f"build_stats_matched_dataset: need num_samples >= 1 and tile_size >= 1 "
                         f"(got {num_samples}, {tile_size})")
    if count_tiles(tile_size, tile_size, tile_size, 1, 1) != 1:  # pragma: no cover - tiling invariant
        raise RuntimeError("a square image of one tile side must make exactly one tile")
    files = [os.path.abspath(str(f)) for f in stats_files]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"build_stats_matched_dataset: stats file not found: {f}")
    params = {"format_version": FORMAT_VERSION, "kind": "stats_matched", "num_samples": int(num_samples),
              "tile_size": int(tile_size), "rule": asdict(rule), "seed": int(seed),
              "stats_files": [os.path.basename(f) for f in files], "stats_digest": _files_digest(files)}
    build_once(out_dir, params, lambda folder: _write_build(folder, files, params, rule))
    return os.path.join(out_dir, "meta_train.json")


def _text(rng: np.random.Generator, n: int) -> str:
    """``n`` bytes of lowercase words (1 byte tokenizer token each; never a reserved token string)."""
    if n <= 0:
        return ""
    return _FILLER[rng.integers(0, len(_FILLER), size=n)].tobytes().decode("ascii")


def _write_build(folder: str, files: list[str], params: dict, rule: LengthRule) -> None:
    plan = sample_plan(files, params["num_samples"], rule, params["seed"])
    rng = np.random.default_rng([params["seed"], 7])
    size = params["tile_size"]
    os.makedirs(os.path.join(folder, "images"))
    pool = []
    for p in range(POOL_IMAGES):
        rel = f"images/pool_{p:02d}.png"
        _save(folder, rel, rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8))
        pool.append(rel)
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        for i in range(params["num_samples"]):
            k = int(plan["vit_num"][i])
            text = int(rule.text_tokens(k, plan["token_num"][i]))
            free = text - int(rule.min_text_tokens(k))  # bytes beyond the shortest sample
            answer_len = 1 + free // 4  # a quarter of the free text is answer (loss), the rest question
            question_len = free - (answer_len - 1)
            question = "<image>\n" * k + _text(rng, question_len)
            record = {
                "id": f"synthetic_{i:06d}",
                "conversations": [{"from": "human", "value": question},
                                  {"from": "gpt", "value": _text(rng, answer_len)}],
                "stats_file": os.path.basename(files[int(plan["file"][i])]),
                "stats_index": int(plan["record"][i]), "vit_num": k, "token_num": int(plan["token_num"][i]),
            }
            if k:
                record["image"] = [pool[int(j)] for j in rng.integers(0, POOL_IMAGES, size=k)]
            f.write(json.dumps(record) + "\n")
    meta = {"synthetic_stats": {"root": ".", "annotation": "train.jsonl", "repeat_time": 1,
                                "length": params["num_samples"]}}
    with open(os.path.join(folder, "meta_train.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(params, f)
