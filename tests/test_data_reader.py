"""InternVL reader: validation errors with file:line, exact sample lengths, truncation, repeat, stats."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from megatron.vlm.data import (ByteTokenizer, DataValidationError, RecordDataset, TileImages, build_digits_dataset,
                               count_tiles, write_stats)

from omnibal_ext.errors import UserError

TOK = ByteTokenizer()
SIZE, TPT = 32, 4


def make_data(folder, lines, meta_extra=None, images=(("a.png", (32, 32)), ("wide.png", (96, 32)))):
    os.makedirs(folder, exist_ok=True)
    for name, (w, h) in images:
        Image.new("RGB", (w, h), (200, 10, 10)).save(os.path.join(folder, name))
    ann = os.path.join(folder, "ann.jsonl")
    with open(ann, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    meta = {"set": {"root": ".", "annotation": "ann.jsonl", **(meta_extra or {})}}
    meta_path = os.path.join(folder, "meta.json")
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return meta_path, ann


def qa(q="<image>\nWhat?", a="It is red.", image="a.png"):
    rec = {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    if image is not None:
        rec["image"] = image
    return rec


def dataset(meta, max_seq_length=4096, **kw):
    return RecordDataset(meta, TOK, TileImages(SIZE, TPT, max_num_tiles=6), max_seq_length=max_seq_length, **kw)


def test_bad_json_line_is_named(tmp_path):
    meta, ann = make_data(tmp_path, [qa(), qa(), '{"conversations": [', qa()])
    with pytest.raises(DataValidationError, match=rf"{ann}:3: not valid JSON"):
        dataset(meta)


def test_missing_image_is_named(tmp_path):
    meta, ann = make_data(tmp_path, [qa(), qa(image=["a.png", "nope.png"], q="<image><image> two?")])
    with pytest.raises(DataValidationError) as e:
        dataset(meta)
    assert f"{ann}:2: image file not found: {os.path.join(tmp_path, 'nope.png')}" in str(e.value)


def test_missing_conversations_is_named(tmp_path):
    meta, ann = make_data(tmp_path, [qa(), {"image": "a.png"}])
    with pytest.raises(DataValidationError, match=rf"{ann}:2: missing 'conversations'"):
        dataset(meta)


@pytest.mark.parametrize("record, counts", [
    (qa(q="<image> and <image>?", image="a.png"), "2 <image> placeholders but 1 images"),
    (qa(q="two images?", image=["a.png", "wide.png"]), "0 <image> placeholders but 2 images"),
    (qa(q="<image> one of two", image=["a.png", "wide.png"]), "1 <image> placeholders but 2 images"),
    (qa(q="<image> but text-only", image=None), "1 <image> placeholders but 0 images"),
])
def test_placeholder_mismatch_is_named(tmp_path, record, counts):
    meta, ann = make_data(tmp_path, [qa(), record])
    with pytest.raises(DataValidationError) as e:
        dataset(meta)
    assert f"{ann}:2: {counts}" in str(e.value)


def test_too_long_is_named_and_all_errors_are_listed(tmp_path):
    long_text = "x" * 300
    meta, ann = make_data(tmp_path, [qa(), qa(a=long_text), "not json", qa(a=long_text)])
    with pytest.raises(DataValidationError) as e:
        dataset(meta, max_seq_length=200)
    msg = str(e.value)
    assert msg.startswith("3 problem(s)")
    assert f"{ann}:2: sample is" in msg and f"{ann}:4: sample is" in msg and f"{ann}:3: not valid JSON" in msg
    assert "> max_seq_length 200" in msg


def test_single_image_without_placeholder_and_text_only(tmp_path):
    meta, _ = make_data(tmp_path, [qa(q="What colour?"), qa(q="Hello?", image=None), "",
                                   qa(q="<image>", image="wide.png")])
    ds = dataset(meta)
    assert len(ds) == 3  # the blank line is not a record
    s0, s1, s2 = ds[0], ds[1], ds[2]
    assert TOK.decode(s0["input_ids"]).count("<IMG_CONTEXT>") == TPT
    assert s1["image_flags"].tolist() == [0] and s1["pixel_values"].shape == (1, 3, SIZE, SIZE)
    assert int((s1["input_ids"] == TOK.img_context_id).sum()) == 0
    assert s2["image_flags"].tolist() == [1] * count_tiles(96, 32, SIZE, 1, 6) == [1, 1, 1, 1]
    assert int((s2["input_ids"] == TOK.img_context_id).sum()) == 4 * TPT


def test_multi_image_tile_budget_is_split(tmp_path):
    meta, _ = make_data(tmp_path, [qa(q="<image><image>", image=["wide.png", "wide.png"]), qa(q="<image>", image="wide.png")],
                        images=(("wide.png", (200, 32)),))
    ds = RecordDataset(meta, TOK, TileImages(SIZE, TPT, max_num_tiles=6))
    # alone: 6 tiles (6x1) + thumbnail; two images: 3 tiles each (3x1) + thumbnail each
    assert ds.sample_lengths()[1].tolist() == [8, 7]
    assert [len(ds[i]["image_flags"]) for i in range(2)] == [8, 7]


def test_meta_length_and_repeat(tmp_path):
    lines = [qa(a=str(k)) for k in range(10)]
    meta, _ = make_data(tmp_path, lines, {"length": 9})
    with pytest.raises(DataValidationError, match="says length 9 but"):
        dataset(meta)
    meta, _ = make_data(tmp_path, lines, {"length": 10, "repeat_time": 2.5})
    ds = dataset(meta)
    assert len(ds) == 25
    answers = [TOK.decode(ds[i]["input_ids"]).rsplit("assistant\n", 1)[1][:1] for i in range(len(ds))]
    counts = np.bincount([int(a) for a in answers], minlength=10)
    assert sorted(counts.tolist()) == [2] * 5 + [3] * 5  # every record twice, half of them thrice
    assert ds.where(24).endswith(":" + str(int(ds.scan.rec_line[ds.scan.order[24]])))


@pytest.fixture(scope="module")
def digits_meta(tmp_path_factory):
    return build_digits_dataset(str(tmp_path_factory.mktemp("digits") / "d"), num_samples=150, tile_size=SIZE)


def check_sample_lengths(ds):
    tokens, tiles = ds.sample_lengths()
    real = ds.sample_real_items()
    for i in range(len(ds)):
        s = ds[i]
        assert len(s["input_ids"]) == len(s["labels"]) == tokens[i]
        assert len(s["pixel_values"]) == len(s["image_flags"]) == tiles[i]
        assert int(s["image_flags"].sum()) == real[i]
        assert int((s["input_ids"] == TOK.img_context_id).sum()) == real[i] * TPT
        assert s["pixel_values"].dtype == torch.float32 and s["input_ids"].dtype == torch.int64
    return tokens, tiles


def test_sample_lengths_equal_getitem_on_digits(digits_meta):
    ds = dataset(digits_meta, max_seq_length=1024)
    tokens, tiles = check_sample_lengths(ds)
    assert len(set(tiles.tolist())) >= 4 and tokens.min() < tokens.max()


def test_truncation_keeps_invariants_on_digits(digits_meta):
    with pytest.raises(DataValidationError, match="max_seq_length 60"):
        dataset(digits_meta, max_seq_length=60)
    with pytest.warns(UserWarning, match="truncated"):
        ds = dataset(digits_meta, max_seq_length=60, truncate=True)
    tokens, _ = check_sample_lengths(ds)
    assert tokens.max() <= 60 and ds.scan.num_truncated > 0


def test_write_stats_equals_sample_lengths(digits_meta, tmp_path):
    out = tmp_path / "stats" / "digits.json"
    n = write_stats(digits_meta, str(out), TOK, TileImages(SIZE, TPT, max_num_tiles=6), progress=False)
    stats = json.loads(out.read_text())
    ds = dataset(digits_meta, max_seq_length=None)
    tokens, tiles = ds.sample_lengths()
    assert n == len(stats) == len(ds)
    assert [s["token_num"] for s in stats] == tokens.tolist()
    assert [s["vit_num"] for s in stats] == tiles.tolist()
    assert [s["image_flags"] for s in stats] == [int(ds[i]["image_flags"].sum()) for i in range(len(ds))]
    assert any(s["image_flags"] == 0 and s["vit_num"] == 1 for s in stats)  # text-only samples


def test_min_num_tiles_as_internvl(tmp_path):
    """min_num_tiles forbids the smaller grids; a multi-image split below it falls back to one tile per
    image (InternVL's empty grid list); min above max is a user error."""
    from megatron.vlm.data import ReaderConfig
    from omnibal_ext.errors import UserError

    two = qa(q="<image>\n<image>\nBoth?", image=["a.png", "wide.png"])
    meta, _ = make_data(tmp_path, [qa(), qa(image="wide.png"), two])
    ds = RecordDataset(meta, TOK, TileImages(SIZE, TPT, max_num_tiles=6, min_num_tiles=4))
    # a.png 32x32: grids of 4..6 tiles, closest square (2,2) + thumbnail; wide 96x32: (3,1) excluded -> (4,1)
    assert ds.sample_lengths()[1].tolist() == [5, 5, 2]  # two images: limit 3 < 4 -> one tile each
    assert [len(ds[i]["pixel_values"]) for i in range(3)] == [5, 5, 2]
    assert TileImages(SIZE, TPT, 6, min_num_tiles=4).tile_range(1) == (4, 6)
    assert TileImages(SIZE, TPT, 6, min_num_tiles=4).tile_range(2) == (1, 1)
    with pytest.raises(UserError, match="min_num_tiles <= max_num_tiles"):
        TileImages(SIZE, TPT, 6, min_num_tiles=7)


def test_meta_scanned_with_the_model_tile_size(tmp_path):
    """`omnibal plan --data meta.json` counts tiles at the model's tile size (tiny: 32 px)."""
    from omnibal_cli import load_stats_or_meta
    from omnibal_ext.model.units import get_preset

    meta, _ = make_data(tmp_path, [qa(image="sq.png")], images=(("sq.png", (64, 64)),))
    stats_tiny = load_stats_or_meta([meta], "--data", get_preset("tiny"))
    stats_default = load_stats_or_meta([meta], "--data")
    assert stats_tiny.vit.tolist() == [5] and stats_default.vit.tolist() == [1]  # 2x2 + thumbnail at 32 px


def _two_sources(tmp_path, bad=False):
    """Two annotation files: one- and two-image records, text-only ones, blank lines, a fractional repeat."""
    a_lines = [qa(a=str(k), image=["a.png", "wide.png"][k % 2]) for k in range(7)]
    a_lines[2] = qa(q="<image><image> both?", image=["wide.png", "a.png"])
    a_lines.insert(4, "")
    b_lines = [qa(q="Hi?", image=None), qa(a="x" * 120), qa(q="<image>\n<image>", image=["a.png", "a.png"])]
    if bad:
        a_lines[1] = "not json"
        b_lines[0] = qa(q="<image><image> two?", image=["nope.png", "gone.png"])
    make_data(tmp_path / "a", a_lines)
    make_data(tmp_path / "b", b_lines)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"a": {"root": "a", "annotation": "a/ann.jsonl", "repeat_time": 1.5},
                                "b": {"root": "b", "annotation": "b/ann.jsonl"}}))
    return str(meta)


# the data is truncated on purpose (max_seq_length 100); test_truncation_keeps_invariants_on_digits asserts the warning
@pytest.mark.filterwarnings("ignore:.*truncated to max_seq_length:UserWarning")
@pytest.mark.parametrize("world", [2, 3, 5])
def test_scan_split_over_processes_equals_one_process(tmp_path, world):
    """The scan of a distributed run (each process takes every world-th record, then all-gather) gives the
    one-process scan's result exactly, and the same problems in the same order."""
    from megatron.vlm.data.records import ReaderConfig, merge_shares, read_meta, scan_annotations, scan_share

    meta = _two_sources(tmp_path)
    config = ReaderConfig(TileImages(SIZE, TPT, 6), max_seq_length=100, truncate=True, seed=3)
    one = scan_annotations(meta, TOK, config, progress=False)
    sources = read_meta(meta)
    split = merge_shares(meta, sources, [scan_share(sources, TOK, config, r, world) for r in range(world)], config)
    for field in ("rec_source", "rec_offset", "rec_line", "img_ptr", "img_width", "img_height", "img_items",
                  "rec_tokens", "rec_images_kept", "rec_real_items", "rec_items", "order"):
        np.testing.assert_array_equal(getattr(split, field), getattr(one, field), err_msg=field)
    assert (split.num_truncated, split.num_without_loss) == (one.num_truncated, one.num_without_loss) != (0, 0)
    assert len(one.img_width) > len(one.rec_line) > 8  # multi-image records are in it

    bad = _two_sources(tmp_path / "bad", bad=True)
    with pytest.raises(DataValidationError) as expected:
        scan_annotations(bad, TOK, config, progress=False)
    sources = read_meta(bad)
    with pytest.raises(DataValidationError) as got:
        merge_shares(bad, sources, [scan_share(sources, TOK, config, r, world) for r in range(world)], config)
    assert str(got.value) == str(expected.value)
    assert str(got.value).startswith("3 problem(s)") and "nope.png" in str(got.value) and "gone.png" in str(got.value)


# the data is truncated on purpose (max_seq_length 100); test_truncation_keeps_invariants_on_digits asserts the warning
@pytest.mark.filterwarnings("ignore:.*truncated to max_seq_length:UserWarning")
def test_scan_cache_is_read_back_and_follows_its_inputs(tmp_path, monkeypatch, capsys):
    """A second scan of the same data, configuration and tokenizer is read from the cache (no image decoded);
    changing the annotation or the configuration scans again."""
    from megatron.vlm.data import records
    from megatron.vlm.data.records import ReaderConfig, scan_annotations

    meta = _two_sources(tmp_path)
    cache = str(tmp_path / "cache")
    config = ReaderConfig(TileImages(SIZE, TPT, 6), max_seq_length=100, truncate=True)
    first = scan_annotations(meta, TOK, config, progress=False, cache_dir=cache)
    decoded = []
    monkeypatch.setattr(records, "decoded_size", lambda path: decoded.append(path) or Image.open(path).size)
    again = scan_annotations(meta, TOK, config, progress=False, cache_dir=cache)
    assert decoded == [] and "is read from" in capsys.readouterr().out
    for field in ("rec_offset", "img_ptr", "img_items", "rec_tokens", "rec_real_items", "order"):
        np.testing.assert_array_equal(getattr(again, field), getattr(first, field))
    assert (again.num_truncated, again.sources) == (first.num_truncated, first.sources)

    other = scan_annotations(meta, TOK, ReaderConfig(TileImages(SIZE, TPT, 2), max_seq_length=100, truncate=True),
                             progress=False, cache_dir=cache)
    assert decoded and other.img_items.sum() < first.img_items.sum()  # another tile budget: scanned again
    decoded.clear()
    ann = tmp_path / "b" / "ann.jsonl"
    ann.write_text(ann.read_text() + json.dumps(qa(a="one more")) + "\n")
    grown = scan_annotations(meta, TOK, config, progress=False, cache_dir=cache)
    assert decoded and len(grown.rec_line) == len(first.rec_line) + 1


def test_an_image_path_that_is_a_folder_or_a_url_is_named(tmp_path):
    (tmp_path / "pics").mkdir(parents=True)
    structured = {"messages": [{"role": "user", "content": [{"type": "image", "url": "https://example.com/cat.jpg"},
                                                            {"type": "text", "text": "What?"}]},
                               {"role": "assistant", "content": "A cat."}]}
    video = {"messages": [{"role": "user", "content": "<video>What?"}, {"role": "assistant", "content": "x"}],
             "videos": ["s3://bucket/v.mp4"]}
    meta, ann = make_data(tmp_path, [qa(), qa(image="pics"), structured, video])
    with pytest.raises(DataValidationError) as e:
        dataset(meta)
    lines = [line.strip() for line in str(e.value).splitlines()[1:]]
    assert lines[:3] == [
        f"{ann}:2: image {os.path.join(tmp_path, 'pics')} is a folder, not an image file",
        f"{ann}:3: image https://example.com/cat.jpg: a URL, and URLs are not fetched: download the file and give its "
        "path (relative to the data folder)",
        f"{ann}:4: video s3://bucket/v.mp4: a URL, and URLs are not fetched: download the file and give its path "
        "(relative to the data folder)"]


def test_an_image_damaged_after_the_scan_is_named_when_loaded(tmp_path):
    """The scan (perhaps read back from its cache) saw a good image; the file was cut afterwards: loading the sample
    names the record and the file instead of PIL's bare "image file is truncated"."""
    meta, ann = make_data(tmp_path, [qa(), qa(image="noise.png")])
    noise = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "noise.png")
    ds = dataset(meta)
    data = (tmp_path / "noise.png").read_bytes()
    (tmp_path / "noise.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=rf"{ann}:2: cannot decode image {tmp_path / 'noise.png'} "
                                        r"\(image file is truncated"):
        ds[1]


def test_a_worker_error_keeps_its_one_line():
    """torch's DataLoader re-raises a worker's exception with the worker's traceback in its text; the loader
    (MicroBatches) gives it back its own message."""
    from megatron.vlm.stage.batches import worker_message

    class Bad(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            raise DataValidationError("ann.jsonl:2: image a.png does not decode any more")

    with pytest.raises(DataValidationError) as e:
        next(iter(torch.utils.data.DataLoader(Bad(), num_workers=1)))
    assert "Traceback" in str(e.value)
    assert worker_message(e.value) == "ann.jsonl:2: image a.png does not decode any more"
    assert worker_message(DataValidationError("plain: one line")) == "plain: one line"


def test_a_cut_or_corrupt_jpeg_is_refused_by_the_scan(tmp_path):
    """The scan decodes JPEGs at 1/8 scale (draft mode), which still reads the whole compressed stream: a JPEG cut
    in half and one whose entropy-coded data holds a stray marker, both with a header that reads fine, are refused
    naming record and file; a good JPEG's size is its full size, not the draft's."""
    import io
    buf = io.BytesIO()
    Image.effect_noise((320, 240), 60).convert("RGB").save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    scan = data.index(b"\xff\xda")  # start of scan: the entropy-coded data follows
    mid = scan + (len(data) - scan) // 2
    (tmp_path / "good.jpg").write_bytes(data)
    (tmp_path / "cut.jpg").write_bytes(data[: mid])
    (tmp_path / "corrupt.jpg").write_bytes(data[:mid] + b"\xff\xc0" + data[mid + 2:])
    for name in ("cut.jpg", "corrupt.jpg"):
        with Image.open(tmp_path / name) as im:
            assert im.size == (320, 240)  # the header alone does not tell
    meta, ann = make_data(tmp_path, [qa(image="good.jpg"), qa(image="cut.jpg"), qa(image="corrupt.jpg")])
    with pytest.raises(DataValidationError) as e:
        dataset(meta)
    lines = [line.strip() for line in str(e.value).splitlines()[1:]]
    assert len(lines) == 2
    assert lines[0].startswith(f"{ann}:2: cannot decode image {tmp_path / 'cut.jpg'}: image file is truncated")
    assert lines[1] == (f"{ann}:3: cannot decode image {tmp_path / 'corrupt.jpg'}: "
                        "broken data stream when reading image file")
    meta, _ = make_data(tmp_path / "ok", [qa(image="../good.jpg")])
    scan = dataset(meta).scan
    assert (scan.img_width.tolist(), scan.img_height.tolist()) == ([320], [240])
