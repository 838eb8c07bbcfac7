"""The built-in digits dataset: deterministic, idempotent, answers and pixels true to sklearn's digits."""
import hashlib
import json
import os
import re

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from megatron.vlm.data import build_digits_dataset, digits_meta_paths
from megatron.vlm.data.digits import NOISE
from omnibal_ext.errors import UserError

TILE = 32


def tree_digest(folder):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, folder).encode())
            h.update(open(path, "rb").read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("digits") / "d")
    meta = build_digits_dataset(out, num_samples=120, num_val_samples=40, seed=3, tile_size=TILE)
    return out, meta


def records(out, split):
    with open(os.path.join(out, f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_deterministic(built, tmp_path):
    out, _ = built
    other = str(tmp_path / "again")
    build_digits_dataset(other, num_samples=120, num_val_samples=40, seed=3, tile_size=TILE)
    assert tree_digest(other) == tree_digest(out)
    different = str(tmp_path / "seed4")
    build_digits_dataset(different, num_samples=120, num_val_samples=40, seed=4, tile_size=TILE)
    assert tree_digest(different) != tree_digest(out)


def test_idempotent_and_guarded(built):
    out, meta = built
    before = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in ("train.jsonl", ".complete.json")}
    assert build_digits_dataset(out, num_samples=120, num_val_samples=40, seed=3, tile_size=TILE) == meta
    assert before == {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in before}
    with pytest.raises(UserError, match="built with"):
        build_digits_dataset(out, num_samples=121, num_val_samples=40, seed=3, tile_size=TILE)


def test_metas_and_splits(built):
    out, meta = built
    train_meta, val_meta = digits_meta_paths(out)
    assert meta == train_meta
    assert json.load(open(train_meta))["digits_train"]["length"] == len(records(out, "train")) == 120
    assert json.load(open(val_meta))["digits_val"]["length"] == len(records(out, "val")) == 40
    train_src = {s for r in records(out, "train") for s in r["sources"]}
    val_src = {s for r in records(out, "val") for s in r["sources"]}
    assert train_src and val_src and not (train_src & val_src)
    assert {r["task"] for r in records(out, "train")} == {"single", "pair_sum", "number", "text"}


def expected_answers(record, labels):
    """The answers recomputed from sklearn's labels of the record's source images (or the question)."""
    digits = [int(labels[s]) for s in record["sources"]]
    conv = record["conversations"]
    task = record["task"]
    if task == "single":
        out = [str(digits[0])]
        if len(conv) == 4:
            out.append("yes" if digits[0] % 2 == 0 else "no")
        return out
    if task == "pair_sum":
        return [str(sum(digits))]
    if task == "number":
        assert digits[0] != 0
        return ["".join(map(str, digits))]
    out = []
    for turn in conv[0::2]:
        a, op, b = re.fullmatch(r"What is (\d) (plus|minus|times) (\d)\?", turn["value"]).groups()
        out.append(str({"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}[op]))
    return out


@pytest.mark.parametrize("split", ["train", "val"])
def test_answers_and_pixels_match_sources(built, split):
    out, _ = built
    sk = load_digits()
    for record in records(out, split):
        answers = [t["value"] for t in record["conversations"][1::2]]
        assert answers == expected_answers(record, sk.target), record["id"]
        paths = record.get("image", [])
        paths = [paths] if isinstance(paths, str) else paths
        assert len(paths) == record["conversations"][0]["value"].count("<image>")
        for k, rel in enumerate(paths):
            pixels = np.asarray(Image.open(os.path.join(out, rel)), dtype=np.int64)
            covered = np.zeros(pixels.shape, bool)
            for place in (p for p in record["render"] if p["image"] == k):
                f = place["scale"]
                clean = np.kron(np.rint(sk.images[place["source"]] * 255 / 16), np.ones((f, f)))
                y, x = place["y"], place["x"]
                region = pixels[y:y + 8 * f, x:x + 8 * f]
                assert region.shape == clean.shape
                diff = region - clean
                assert ((diff >= 0) & (diff <= NOISE) | (region == 255)).all(), record["id"]
                covered[y:y + 8 * f, x:x + 8 * f] = True
            assert pixels[~covered].max() <= NOISE  # background is black + noise only
        if record["task"] == "number":
            w, h = Image.open(os.path.join(out, paths[0])).size
            assert w > 1.5 * h  # wide enough to be cut into several tiles
