"""The built-in default dataset: scikit-learn's 8x8 digits written out as a meta JSON with ``conversations`` records.

``build_digits_dataset(out_dir)`` writes (paths in the metas are relative to ``out_dir``)::

    out_dir/images/{train,val}_NNNNNN_K.png   greyscale PNGs
    out_dir/train.jsonl, out_dir/val.jsonl    annotations
    out_dir/meta_train.json                   {"digits_train": {"root": ".", "annotation": "train.jsonl", ...}}
    out_dir/meta_val.json                     {"digits_val": {...}}   (held-out split, separate meta)
    out_dir/.complete.json                    marker with the build parameters (written last)

The 1797 source images are split once (seeded): 20 % of them feed only the validation split, so no source
digit image appears in both.  Tasks, mixed at random (short, checkable answers):

* ``single``  one digit on a canvas of ``tile_size`` px, or 30 % of the time 1.5-2x larger (so it is cut
  into a 2x2 grid + thumbnail); "What digit is shown in the image?" -> "7"; a quarter get a second turn
  "Is it even?" -> "yes"/"no".
* ``pair_sum`` two single-digit images; "<image>\\n<image>\\nWhat is the sum of the two digits?" -> "12".
* ``number``  2-3 digits side by side on a wide canvas (aspect about 2:1 or 3:1, so several tiles +
  thumbnail); "Read the number in the image." -> "382" (first digit never 0).
* ``text``    text-only arithmetic, one or two turns: "What is 3 plus 4?" -> "7".

Each digit is upscaled by an integer factor (nearest neighbour, grey level ``v * 255 / 16``), placed at a
random offset on a black canvas, and the canvas gets uniform integer noise in [0, ``NOISE``].  Records
carry the ground truth for tests and evaluation: ``task``, ``sources`` (sklearn indices) and ``render``
(one ``{"image", "source", "x", "y", "scale"}`` per placed digit).
"""
from __future__ import annotations

import json
import os
import shutil
import uuid

import numpy as np
from PIL import Image

from omnibal_ext.errors import UserError

FORMAT_VERSION = 3
NOISE = 12  # max added grey level
MARKER = ".complete.json"
VAL_SOURCE_FRACTION = 0.2
# Mostly single digits: a model trained from scratch first has to learn to read one digit before
# sums and numbers pay off; short questions keep CPU sequences short.
TASK_WEIGHTS = {"single": 0.7, "pair_sum": 0.1, "number": 0.1, "text": 0.1}

SINGLE_QUESTIONS = ("Which digit is this?", "What digit is shown?")
PAIR_QUESTIONS = ("Sum of the two digits?", "Add the two digits.")
NUMBER_QUESTIONS = ("Read the number.", "Which number is this?")
TEXT_OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


class DatasetFolderError(UserError):
    """A dataset folder that holds something else than the build asked for."""


def digits_meta_paths(out_dir: str) -> tuple[str, str]:
    """(train meta, val meta) paths of a digits build in ``out_dir``."""
    return os.path.join(out_dir, "meta_train.json"), os.path.join(out_dir, "meta_val.json")


def _params(num_samples: int, num_val_samples: int, seed: int, tile_size: int) -> dict:
    return {"format_version": FORMAT_VERSION, "num_samples": num_samples, "num_val_samples": num_val_samples,
            "seed": seed, "tile_size": tile_size}


def _read_marker(out_dir: str) -> dict | None:
    try:
        with open(os.path.join(out_dir, MARKER)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def build_digits_dataset(out_dir: str, num_samples: int = 2000, seed: int = 0, tile_size: int = 32,
                         num_val_samples: int | None = None) -> str:
    """Write the digits dataset into ``out_dir`` (if not already there) and return the TRAIN meta path.

    Idempotent: a complete build with the same parameters is reused untouched.  A complete build with
    other parameters is an error (pick another ``out_dir``).  The build goes to a temporary sibling folder
    that is renamed into place, so concurrent callers (several ranks) never see half a dataset.
    ``num_val_samples`` defaults to ``max(20, num_samples // 10)``.  The val meta is
    ``digits_meta_paths(out_dir)[1]``.
    """
    if num_samples < 1 or tile_size < 16:
        raise ValueError(f"build_digits_dataset: need num_samples >= 1 and tile_size >= 16 "
                         f"(got {num_samples}, {tile_size})")
    if num_val_samples is None:
        num_val_samples = max(20, num_samples // 10)
    params = _params(num_samples, num_val_samples, seed, tile_size)
    train_meta = digits_meta_paths(out_dir)[0]
    build_once(out_dir, params, lambda folder: _write_build(folder, params))
    return train_meta


def build_once(out_dir: str, params: dict, write) -> None:
    """Make ``out_dir`` with ``write(folder)`` unless a complete build with ``params`` is there.

    The build goes to a temporary sibling folder renamed into place at the end, so concurrent
    builders (several ranks) never see half a dataset; ``write`` must leave the MARKER file with
    ``params`` in the folder last.  A complete build with other parameters, or a non-empty folder
    without a marker, is an error.
    """
    existing = _read_marker(out_dir)
    if existing is not None:
        if existing == params:
            return
        raise DatasetFolderError(f"{out_dir} holds a dataset built with {existing}, not {params}; "
                                 "use another folder or delete it")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise DatasetFolderError(f"{out_dir} exists, is not empty and holds no complete build; "
                                 "use another folder or delete it")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        try:
            os.rename(tmp, out_dir)  # replaces an empty out_dir; fails if another builder won the race
        except OSError:
            if _read_marker(out_dir) != params:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_build(folder: str, params: dict) -> None:
    from sklearn.datasets import load_digits  # a slow import: only when the digits dataset is built

    digits = load_digits()
    images, labels = digits.images, digits.target.astype(int)  # [1797, 8, 8] in 0..16, [1797]
    rng = np.random.default_rng(params["seed"])
    perm = rng.permutation(len(images))
    n_val = int(round(len(images) * VAL_SOURCE_FRACTION))
    split_sources = {"val": np.sort(perm[:n_val]), "train": np.sort(perm[n_val:])}
    os.makedirs(os.path.join(folder, "images"))
    counts = {"train": params["num_samples"], "val": params["num_val_samples"]}
    for split in ("train", "val"):
        split_rng = np.random.default_rng([params["seed"], 1 if split == "train" else 2])
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for i in range(counts[split]):
                record = _make_record(split, i, split_rng, split_sources[split], images, labels,
                                      params["tile_size"], folder)
                f.write(json.dumps(record) + "\n")
        meta = {f"digits_{split}": {"root": ".", "annotation": f"{split}.jsonl", "repeat_time": 1,
                                    "length": counts[split]}}
        with open(os.path.join(folder, f"meta_{split}.json"), "w") as f:
            json.dump(meta, f, indent=1)
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(params, f)


def _digit_scale(canvas_height: int) -> int:
    """Integer upscale of an 8 px digit so that it fills about 3/4 of the canvas height."""
    return max(1, (canvas_height * 3) // 32)


def _render(width: int, height: int, placements: list[tuple[np.ndarray, int, int, int]],
            rng: np.random.Generator) -> np.ndarray:
    """uint8 [height, width] canvas: each (digit 8x8 in 0..16, x, y, scale) pasted, then noise added."""
    canvas = np.zeros((height, width), dtype=np.int32)
    for digit, x, y, scale in placements:
        block = np.kron(np.rint(digit * 255.0 / 16.0).astype(np.int32), np.ones((scale, scale), np.int32))
        canvas[y:y + block.shape[0], x:x + block.shape[1]] = block
    canvas += rng.integers(0, NOISE + 1, size=canvas.shape)
    return np.clip(canvas, 0, 255).astype(np.uint8)


def _save(folder: str, rel: str, pixels: np.ndarray) -> None:
    Image.fromarray(pixels).save(os.path.join(folder, rel), compress_level=1)


def _single_image(rng, source: int, images, canvas: int) -> tuple[np.ndarray, dict]:
    scale = _digit_scale(canvas)
    x, y = (int(v) for v in rng.integers(0, canvas - 8 * scale + 1, size=2))
    pixels = _render(canvas, canvas, [(images[source], x, y, scale)], rng)
    return pixels, {"source": int(source), "x": x, "y": y, "scale": scale}


def _make_record(split: str, i: int, rng: np.random.Generator, sources: np.ndarray, images, labels,
                 tile_size: int, folder: str) -> dict:
    task = str(rng.choice(list(TASK_WEIGHTS), p=list(TASK_WEIGHTS.values())))
    rid = f"digits_{split}_{i:06d}"
    record: dict = {"id": rid, "task": task}
    if task == "text":
        turns = []
        for _ in range(1 if rng.random() < 0.7 else 2):
            op = str(rng.choice(list(TEXT_OPS)))
            a, b = (int(v) for v in rng.integers(0, 10, size=2))
            if op == "minus" and a < b:
                a, b = b, a
            turns += [{"from": "human", "value": f"What is {a} {op} {b}?"},
                      {"from": "gpt", "value": str(TEXT_OPS[op](a, b))}]
        record["conversations"] = turns
        record["sources"], record["render"] = [], []
        return record
    if task == "single":
        source = int(rng.choice(sources))
        canvas = tile_size if rng.random() < 0.7 else int(round(tile_size * rng.uniform(1.5, 2.0)))
        pixels, place = _single_image(rng, source, images, canvas)
        rel = f"images/{split}_{i:06d}_0.png"
        _save(folder, rel, pixels)
        digit = int(labels[source])
        turns = [{"from": "human", "value": "<image>\n" + str(rng.choice(SINGLE_QUESTIONS))},
                 {"from": "gpt", "value": str(digit)}]
        if rng.random() < 0.25:
            turns += [{"from": "human", "value": "Is it even?"},
                      {"from": "gpt", "value": "yes" if digit % 2 == 0 else "no"}]
        record.update(image=rel, conversations=turns, sources=[source], render=[dict(image=0, **place)])
        return record
    if task == "pair_sum":
        chosen = [int(s) for s in rng.choice(sources, size=2)]
        rels, render = [], []
        for k, source in enumerate(chosen):
            pixels, place = _single_image(rng, source, images, tile_size)
            rel = f"images/{split}_{i:06d}_{k}.png"
            _save(folder, rel, pixels)
            rels.append(rel)
            render.append(dict(image=k, **place))
        question = "<image>\n<image>\n" + str(rng.choice(PAIR_QUESTIONS))
        answer = str(sum(int(labels[s]) for s in chosen))
        record.update(image=rels, conversations=[{"from": "human", "value": question},
                                                 {"from": "gpt", "value": answer}],
                      sources=chosen, render=render)
        return record
    # number: 2-3 digits side by side, first one non-zero
    n = int(rng.integers(2, 4))
    nonzero = sources[labels[sources] != 0]
    chosen = [int(rng.choice(nonzero))] + [int(s) for s in rng.choice(sources, size=n - 1)]
    height = tile_size
    width = n * tile_size + int(rng.integers(-tile_size // 4, tile_size // 4 + 1))
    scale = _digit_scale(height)
    slot = width // n
    placements, render = [], []
    for k, source in enumerate(chosen):
        x = k * slot + int(rng.integers(0, max(0, slot - 8 * scale) + 1))
        y = int(rng.integers(0, height - 8 * scale + 1))
        placements.append((images[source], x, y, scale))
        render.append({"image": 0, "source": source, "x": x, "y": y, "scale": scale})
    pixels = _render(width, height, placements, rng)
    rel = f"images/{split}_{i:06d}_0.png"
    _save(folder, rel, pixels)
    answer = "".join(str(int(labels[s])) for s in chosen)
    record.update(image=rel, conversations=[{"from": "human", "value": "<image>\n" + str(rng.choice(NUMBER_QUESTIONS))},
                                            {"from": "gpt", "value": answer}],
                  sources=chosen, render=render)
    return record
