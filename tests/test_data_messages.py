"""Every family reads ``messages`` records (LLaMA-Factory / ms-swift JSONL, string content with ``<image>`` tags, or
transformers' structured content parts) and ``conversations`` records alike: the same conversations written in
every format give the reader bit-identical samples, whether the JSONL comes through a meta JSON entry or directly
as the data path; a messages record's problems are named with ``file:line``."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from megatron.vlm.data import DataValidationError, RecordDataset, TileImages
from megatron.vlm.data.tokenizer import build_tokenizer

CONVERSATIONS = [  # (images, [(user, assistant), ...], system)
    (["a.png"], [("<image>\nWhat digit?", "7")], None),
    (["a.png", "wide.png"], [("<image> and <image>: sum?", "12"), ("Sure?", "yes")], "Be exact."),
    ([], [("2+3?", "5")], None),
]


def as_internvl(images, turns, system):
    conv = ([{"from": "system", "value": system}] if system else [])
    for q, a in turns:
        conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return {"image": images, "conversations": conv} if images else {"conversations": conv}


def as_messages(images, turns, system):
    messages = ([{"role": "system", "content": system}] if system else [])
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages, "images": images}


def structured(text, images, key="image"):
    """``text``'s ``<image>`` tags as transformers' image parts (paths from ``images``, in order), the rest as text
    parts; returns (parts, images left)."""
    pieces = text.split("<image>")
    parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for piece in pieces[1:]:
        parts.append({"type": "image", key: images[0]})
        images = images[1:]
        parts += [{"type": "text", "text": piece}] if piece else []
    return parts, images


def as_structured(images, turns, system, key="image"):
    """The conversation in transformers' structured form: every content a list of parts, images in the parts."""
    messages = ([{"role": "system", "content": [{"type": "text", "text": system}]}] if system else [])
    for q, a in turns:
        parts, images = structured(q, images, key)
        messages += [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text",
                                                                                            "text": a}]}]
    return {"messages": messages}


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 256, (30, 90, 3), dtype=np.uint8)).save(tmp_path / "wide.png")
    for name, fmt in (("internvl", as_internvl), ("messages", as_messages), ("structured", as_structured)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(fmt(*c)) + "\n" for c in CONVERSATIONS))
        (tmp_path / f"{name}.json").write_text(json.dumps({name: {"root": ".", "annotation": f"{name}.jsonl"}}))
    return tmp_path


def read(path):
    return RecordDataset(str(path), build_tokenizer(None), TileImages(image_size=32, tokens_per_tile=4, max_num_tiles=4))


def test_messages_and_internvl_records_give_the_same_samples(data):
    want = read(data / "internvl.json")
    for path in (data / "messages.json", data / "messages.jsonl", data / "internvl.jsonl", data / "structured.jsonl"):
        got = read(path)
        assert all(np.array_equal(a, b) for a, b in zip(got.sample_lengths(), want.sample_lengths()))
        for i in range(len(CONVERSATIONS)):
            a, b = got[i], want[i]
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) for k in a), (path, i)
    assert read(data / "messages.jsonl").where(1) == f"{data / 'messages.jsonl'}:2"
    assert int(want.sample_real_items()[2]) == 0 and want.sample_lengths()[1][2] == 1  # text-only: a dummy tile


def test_messages_record_problems_name_file_and_line(data):
    bad = data / "bad.jsonl"
    good = as_messages(*CONVERSATIONS[0])
    bad.write_text("\n".join(json.dumps(r) for r in [
        good, {**good, "images": []}, {"messages": [{"role": "assistant", "content": "x"}]},
        {**good, "videos": ["v.mp4"]}]) + "\n")
    with pytest.raises(DataValidationError) as e:
        read(bad)
    lines = str(e.value).splitlines()[1:]
    assert lines[0].strip() == f"{bad}:2: 1 <image> placeholder(s) in the messages but 0 image(s) in 'images'"
    assert lines[1].strip().startswith(f"{bad}:3: messages[0] is from assistant, expected user")
    assert lines[2].strip() == f"{bad}:4: 0 <video> placeholder(s) in the messages but 1 video(s) in 'videos'"


def test_structured_content_is_the_string_form():
    """Each conversation in transformers' structured form (image paths under "image", "url" or "path"), and mixed
    with string contents, parses to the string form's turns and images."""
    from megatron.vlm.data.messages import parse_messages_record

    for images, turns, system in CONVERSATIONS:
        want = parse_messages_record(as_messages(images, turns, system), "w")
        for key in ("image", "url", "path"):
            got = parse_messages_record(as_structured(images, turns, system, key), "w")
            assert (got.turns, got.images) == (want.turns, want.images), key
    mixed = {"messages": [{"role": "user", "content": "<image>first"}, {"role": "assistant", "content": "a"},
                          {"role": "user", "content": [{"type": "text", "text": "then "}, {"type": "image",
                                                                                         "path": "b.png"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
                          {"role": "user", "content": "and <image>"}, {"role": "assistant", "content": "c"}],
             "images": ["a.png", "c.png"]}
    got = parse_messages_record(mixed, "m")
    assert got.images == ("a.png", "b.png", "c.png")  # reading order: tag, part, tag
    assert [t.text for t in got.turns] == ["<image>first", "a", "then <image>", "b", "and <image>", "c"]


@pytest.mark.parametrize("content, images, error", [
    ([{"type": "image"}, {"type": "text", "text": "q"}], None, r"content\[0\]: an image part needs one path"),
    ([{"type": "image", "image": ""}], None, r"content\[0\]: an image part needs one path"),
    ([{"type": "image", "image": "a.png", "url": "b.png"}], None, r"content\[0\]: an image part needs one path"),
    ([{"type": "text", "text": "<image> q"}], ["a.png"], r"content\[0\]: a text part holds <image>"),
    ([{"type": "text", "text": 3}], None, r"content\[0\]: a text part needs a string 'text'"),
    ([{"type": "video", "video": "v.mp4"}], None, r"1 video\(s\): the model family does not read videos"),
    ([{"type": "video"}], None, r"content\[0\]: a video part needs one path"),
    ([{"type": "audio", "audio": "a.wav"}], None, r"content\[0\]: audio input is not implemented"),
    ([{"type": "table", "rows": []}], None, r"content\[0\]: expected a"),
    ([{"type": "image", "image": "a.png"}], ["b.png"], r"0 <image> placeholder\(s\) .* but 1 image"),
    ("<image><image>", ["b.png"], r"2 <image> placeholder\(s\) .* but 1 image"),
])
def test_bad_structured_records_are_refused_with_file_line(data, content, images, error):
    bad = data / "bad.jsonl"
    record = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "x"}]}
    bad.write_text(json.dumps(as_messages(*CONVERSATIONS[0])) + "\n" + json.dumps(
        {**record, **({"images": images} if images else {})}) + "\n")
    with pytest.raises(DataValidationError, match=rf"{bad}:2: .*{error}"):
        read(bad)
    answer = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]}
    bad.write_text(json.dumps(answer) + "\n")
    with pytest.raises(DataValidationError, match=rf"{bad}:1: messages\[1\] \(assistant\) has an image"):
        read(bad)
