"""Every family reads ``messages`` records (LLaMA-Factory / ms-swift JSONL) and InternVL ``conversations`` records
alike: the same conversations written in both formats give InternVL's reader bit-identical samples, whether the
JSONL comes through a meta JSON entry or directly as the data path; a messages record's problems are named with
``file:line``."""
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


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 256, (30, 90, 3), dtype=np.uint8)).save(tmp_path / "wide.png")
    for name, fmt in (("internvl", as_internvl), ("messages", as_messages)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(fmt(*c)) + "\n" for c in CONVERSATIONS))
        (tmp_path / f"{name}.json").write_text(json.dumps({name: {"root": ".", "annotation": f"{name}.jsonl"}}))
    return tmp_path


def read(path):
    return RecordDataset(str(path), build_tokenizer(None), TileImages(image_size=32, tokens_per_tile=4, max_num_tiles=4))


def test_messages_and_internvl_records_give_the_same_samples(data):
    want = read(data / "internvl.json")
    for path in (data / "messages.json", data / "messages.jsonl", data / "internvl.jsonl"):
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
    assert lines[2].strip() == f"{bad}:4: 'videos': video input is not implemented (images only)"
