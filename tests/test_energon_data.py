"""Energon datasets read by the trainer's reader (megatron/vlm/data/energon/), in one process.

The oracle is the JSONL path (records.RecordDataset, the reader the rest of the suite checks against transformers'
processors): a photo-and-video JSONL in every record form, converted by ``omnibal data to-energon`` into this
trainer's layout and into Megatron-Bridge's, gives from Energon's savable loader the same samples, tokens, labels and
pixels, each once per epoch; a folder written as Bridge's tutorial writes it (tar members, ``energon prepare``'s
split patterns, Bridge's dataset.yaml) reads as the equivalent JSONL record; metadataset blends; the position survives
a save and restore with samples in the look-ahead buffer; bad input is named by shard and sample key."""
from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

pytest.importorskip("megatron.energon")
av = pytest.importorskip("av")

import energon_media  # noqa: E402

from megatron.vlm.data import RecordDataset, TileImages  # noqa: E402
from megatron.vlm.data.energon.convert import ConvertError, prepare, to_energon  # noqa: E402
from megatron.vlm.data.energon.costs import CostModel  # noqa: E402
from megatron.vlm.data.energon.encoder import ChatTaskEncoder, EncoderSettings  # noqa: E402
from megatron.vlm.data.energon.layout import EnergonDataError  # noqa: E402
from megatron.vlm.data.energon.look_ahead import LookAhead  # noqa: E402
from megatron.vlm.data.energon.stream import (EnergonSampleError, LoaderSettings, SampleStream,  # noqa: E402
                                              SkipPolicy)
from megatron.vlm.data.record_sample import ReaderConfig  # noqa: E402
from megatron.vlm.data.tokenizer import build_tokenizer  # noqa: E402
from megatron.vlm.data.video_sampling import VideoOverrides  # noqa: E402
from megatron.vlm.families.internvl import video as internvl  # noqa: E402
from omnibal_ext.data.online_isf import SampleCost  # noqa: E402
from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.cost_model import get_device  # noqa: E402
from omnibal_ext.model.sample_time import time_coefficients  # noqa: E402
from omnibal_ext.model.units import get_preset  # noqa: E402

TOK = build_tokenizer(None)
SPEC = get_preset("internvl3-1b")
COSTS = CostModel(SPEC, time_coefficients(SPEC, get_device("h200-141g")))
FIELDS = ("input_ids", "labels", "pixel_values", "image_flags", "image_sizes")


def config(min_frames=2, max_frames=6, skip_bad=False) -> ReaderConfig:
    """InternVL's rules: 448 px tiles (at most 2 per image), frames as tiles (a frame count drawn per video between the
    bounds)."""
    videos = internvl.FramesAsTiles(internvl.settings(VideoOverrides(min_frames=min_frames, max_frames=max_frames)),
                                    448)
    return ReaderConfig(images=TileImages(448, 4, 2), max_seq_length=4096, videos=videos, skip_bad=skip_bad)


OPEN_STREAMS: list[SampleStream] = []  # this test's streams, closed after it (``close_streams``)


@pytest.fixture(autouse=True)
def close_streams():
    """Each test's streams stop their loader workers when it ends (a dropped one would stop them when a collection
    finds it, 5 s per worker: megatron/vlm/data/loader_workers.py)."""
    yield
    while OPEN_STREAMS:
        OPEN_STREAMS.pop().close()


def stream(path, cfg=None, workers=0, rank=0, world=1, skip=False, report=None, verify=False, pixels=True):
    cfg = cfg or config()
    encoder = ChatTaskEncoder(EncoderSettings(cfg, TOK, COSTS, keep_media=pixels, verify=verify))
    made = SampleStream(LoaderSettings(str(path), "train", True, rank, world, workers, seed=1), encoder,
                        SkipPolicy(skip, report, announce=False))
    OPEN_STREAMS.append(made)
    return made


def epoch(s: SampleStream) -> list:
    """Every sample of the stream's current epoch, in order."""
    out = []
    while True:
        s.fill(len(s.buffer) + 1)
        if s.exhausted:
            out += s.buffer.take(list(range(len(s.buffer))))
            return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return energon_media.write_data(tmp_path_factory.mktemp("media"))


@pytest.mark.parametrize("layout", ["omnibal", "bridge"])
def test_converted_samples_equal_the_jsonl_path(layout, data, tmp_path):
    """Every record: the same input_ids, labels, pixels, flags, sizes and video fields from the converted shards as
    from the JSONL, each sample once per epoch over two epochs (loader workers), costs from headers alone.  Our
    layout keeps InternVL's random frame counts (its records carry their origin); Bridge's draws from the key, so it
    is compared with a fixed count."""
    cfg = config() if layout == "omnibal" else config(4, 4)
    jsonl = RecordDataset(data, TOK, cfg.images, cfg.max_seq_length, videos=cfg.videos)
    done = to_energon(data, str(tmp_path / "en"), layout=layout, samples_per_shard=3)
    assert done.samples == {"train": len(jsonl)} and done.shards == -(-len(jsonl) // 3)
    s = stream(tmp_path / "en", cfg, workers=2)
    for k in range(2):
        samples = epoch(s)
        s.next_epoch()
        assert sorted(energon_media.line_of(x.name) for x in samples) == list(range(1, len(jsonl) + 1))
        if k:
            break
        for x in samples:
            ref, mine = jsonl[energon_media.line_of(x.name) - 1], x.sample(cfg, pixels=True)
            for key in FIELDS + (("video_blocks", "mm_token_type_ids") if "video_blocks" in ref else ()):
                a, b = ref[key], mine[key]
                assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (x.name, key)
            assert x.cost.tokens == len(ref["input_ids"]) and x.cost.vit_items == len(ref["image_flags"])
            assert x.cost.vit_s > 0 and x.cost.llm_s > 0


def write_bridge_folder(folder, samples: list[tuple[str, list, bytes]], member="image.png",
                        yaml_text: str | None = None) -> None:
    """A dataset folder as Megatron-Bridge's tutorial writes it: tar members ``<key>.<member>`` and
    ``<key>.conversation.json``, indexed with Energon's split patterns, then Bridge's dataset.yaml."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    folder.mkdir()
    with tarfile.open(folder / "train-shard-000000.tar", "w") as tar:
        for key, conversation, media in samples:
            for name, payload in ((f"{key}.{member}", media), (f"{key}.conversation.json",
                                                                json.dumps(conversation).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    BaseWebdatasetFactory.prepare_dataset(folder, ["train-shard-000000.tar"],
                                          split_parts_patterns=[("train", "train-shard-.*")], workers=1,
                                          shuffle_seed=None)
    (folder / ".nv-meta" / "dataset.yaml").write_text(yaml_text or (
        "__module__: megatron.bridge.data.energon.task_encoder_utils\n__class__: ChatMLWebdataset\n"
        f"field_map:\n  imgs: {member}\n  conversation: conversation.json\nsubflavors: {{}}\n"))


def png(colour, size=(60, 40)) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), colour, np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_a_bridge_folder_reads_as_its_jsonl_record(tmp_path):
    """Bridge's tutorial sample (typed parts without a path, the image in image.png) and a pickled image list
    (jpgs, string tags) read as the messages records a JSONL writes; Energon's own loader cannot load the folder (its
    dataset.yaml imports Bridge)."""
    from megatron.energon import WorkerConfig, get_train_dataset

    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the dominant colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "The image is red."}]}]
    write_bridge_folder(tmp_path / "one", [("train-000000", conv, png((220, 40, 40)))])
    two = [{"role": "user", "content": "<image> vs <image>: which is green?"},
           {"role": "assistant", "content": "the second"}]
    write_bridge_folder(tmp_path / "many", [("k0", two, pickle.dumps([png((200, 0, 0)), png((0, 200, 0), (90, 30))]))],
                        member="jpgs")
    (tmp_path / "r.png").write_bytes(png((220, 40, 40)))
    (tmp_path / "g.png").write_bytes(png((0, 200, 0), (90, 30)))
    (tmp_path / "d.png").write_bytes(png((200, 0, 0)))
    records = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "r.png"},
                                                          {"type": "text", "text": "What is the dominant colour?"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "The image is red."}]}]},
               {"messages": two, "images": ["d.png", "g.png"]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = config()
    jsonl = RecordDataset(str(tmp_path / "d.jsonl"), TOK, cfg.images, cfg.max_seq_length)
    for k, folder in enumerate(("one", "many")):
        (x,) = epoch(stream(tmp_path / folder, cfg))
        mine, ref = x.sample(cfg, pixels=True), jsonl[k]
        assert all(torch.equal(ref[f], mine[f]) for f in FIELDS), folder
    with pytest.raises(ModuleNotFoundError, match="megatron.bridge"):
        get_train_dataset(str(tmp_path / "one"), worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                          batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None)


def test_metadataset_blends(data, tmp_path):
    """A MetadatasetV2 ``blend_epochized`` gives each epoch every sample of a folder once per repetition (a meta JSON
    of two sources converts into one); a weighted ``blend`` is one endless stream, sampled by weight."""
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"a": {"annotation": data, "root": os.path.dirname(data)},
                                "b": {"annotation": data, "root": os.path.dirname(data), "repeat_time": 2}}))
    done = to_energon(str(meta), str(tmp_path / "out"), samples_per_shard=4)
    assert done.path.endswith("metadataset.yaml") and set(done.samples) == {"a", "b"}
    n = done.samples["a"]
    names = [x.name for x in epoch(stream(done.path, config(4, 4)))]
    assert len(names) == 3 * n
    counts = {name: names.count(name) for name in names}
    assert sorted(counts.values()) == [1] * n + [2] * n  # source a once, b twice (keys s000-... and s001-...)
    weighted = tmp_path / "weighted.yaml"
    weighted.write_text(yaml.safe_dump({"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {
        "train": {"blend": [{"weight": 1, "path": "out/a"}, {"weight": 3, "path": "out/b"}]}}}))
    s = stream(weighted, config(4, 4))
    assert not s.epochs
    s.fill(4 * n)
    assert len(s.buffer) == 4 * n and not s.exhausted


def test_close_stops_the_loader_workers_at_once(data, tmp_path):
    """A closed stream's worker processes have exited when ``close`` returns (dropped inside a garbage collection
    instead, each would wait out torch's 5 s join: megatron/vlm/data/loader_workers.py), and the closed stream is not
    used again; a stream renewed at an epoch's end stops the old loader's workers the same way."""
    to_energon(data, str(tmp_path / "en"), samples_per_shard=2)
    s = stream(tmp_path / "en", workers=2, pixels=False)
    s.next_sample()
    workers = list(s.loader._iterator._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    s.close()
    assert [w.exitcode for w in workers] == [0, 0]
    with pytest.raises(RuntimeError, match="used after close"):
        s.state_dict()
    s = stream(tmp_path / "en", workers=2, pixels=False)
    s.next_sample()
    old = list(s.loader._iterator._workers)
    epoch(s)  # to the epoch's end, where the loader is renewed
    assert [w.exitcode for w in old] == [0, 0]
    assert s.next_sample() is not None and all(w.is_alive() for w in s.loader._iterator._workers)


def test_position_survives_a_restore_with_a_buffer(data, tmp_path):
    """Samples pulled into the look-ahead buffer but not served are fetched again by their restore keys: a fresh
    stream loaded from the saved state serves what the first one goes on to serve (workers); another data-parallel
    size or worker count is refused by name."""
    to_energon(data, str(tmp_path / "en"), samples_per_shard=2)
    first = stream(tmp_path / "en", workers=2, pixels=False)
    served = [first.next_sample().name for _ in range(3)]
    first.fill(4)
    first.buffer.take([2, 0])
    state = pickle.loads(pickle.dumps(first.state_dict()))
    rest = [first.next_sample().name for _ in range(6)]
    second = stream(tmp_path / "en", workers=2, pixels=False)
    second.load_state_dict(state)
    assert [second.next_sample().name for _ in range(6)] == rest and not set(served) & set(rest[:4])
    for workers, world, flag in ((1, 1, "--num-workers 2"), (2, 2, "data-parallel size 1")):
        other = stream(tmp_path / "en", workers=workers, world=world, pixels=False)
        with pytest.raises(UserError, match=flag):
            other.load_state_dict(state)


def corrupt_member(folder, key: str, member: str, payload: bytes) -> None:
    """Overwrite a member's bytes in place (same length), as a disk error would."""
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            info = next((m for m in tar.getmembers() if m.name == f"{key}.{member}"), None)
        if info is not None:
            with open(shard, "r+b") as f:
                f.seek(info.offset_data)
                f.write(payload[:info.size].ljust(info.size, b"\0"))
            return
    raise AssertionError(f"no member {key}.{member}")


def small_data(folder, n: int = 5) -> str:
    """``n`` one-image messages records over small PNGs in ``folder``; returns the JSONL's path."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for k in range(n):
        (folder / f"p{k}.png").write_bytes(png((40 * k, 100, 200), (40 + 8 * k, 30)))
        lines.append({"messages": [{"role": "user", "content": "<image>colour?"},
                                   {"role": "assistant", "content": f"shade {k}"}], "images": [f"p{k}.png"]})
    path = folder / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


def test_bad_input_is_named_by_shard_and_key(tmp_path):
    """A corrupt tar member (an image's bytes overwritten), a member the record names but the sample lacks, pixels
    broken behind a readable header, a Bridge sample whose placeholders and media disagree, a truncated shard, an
    unreadable .nv-meta: each named by shard and sample key (or file), before training or as it is met;
    --skip-bad-samples leaves the samples out, each listed."""
    from megatron.training.energon_data import check_source

    folder = tmp_path / "en"
    to_energon(small_data(tmp_path / "media"), str(folder), samples_per_shard=4)
    corrupt_member(folder, "s000-000000002", "img0.png", b"not an image at all" * 8)
    with pytest.raises(EnergonSampleError, match=r"^train-shard-000000\.tar/s000-000000002: cannot decode image "
                                                 r"member img0\.png \(not an image"):
        epoch(stream(folder))
    report = tmp_path / "skipped.txt"
    kept = epoch(stream(folder, skip=True, report=str(report)))
    assert sorted(energon_media.line_of(x.name) for x in kept) == [1, 3, 4, 5]
    assert report.read_text().startswith("train-shard-000000.tar/s000-000000002: cannot decode image member")

    bad = tmp_path / "missing.jsonl"
    rec = {"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
           "images": ["photo.png"]}
    Image.new("RGB", (50, 40)).save(tmp_path / "photo.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 300, 3), np.uint8)).save(tmp_path / "cut.jpg")
    whole = (tmp_path / "cut.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(whole[:len(whole) // 2])  # the header reads, the pixels do not
    bad.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "images": ["cut.jpg"]}) + "\n")
    to_energon(str(bad), str(tmp_path / "m"), samples_per_shard=1)
    shard0 = tmp_path / "m" / "train-shard-000000.tar"
    members = {}
    with tarfile.open(shard0) as tar:
        for m in tar.getmembers():
            members[m.name] = tar.extractfile(m).read()
    with tarfile.open(shard0, "w") as tar:  # the record names img0.png, the member is gone
        payload = members["s000-000000001.record.json"]
        info = tarfile.TarInfo("s000-000000001.record.json")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    prepare(str(tmp_path / "m"), "omnibal")
    with pytest.raises(EnergonSampleError, match=r"shard-000000\.tar/s000-000000001: .*no such member"):
        epoch(stream(tmp_path / "m"))
    s = stream(tmp_path / "m", skip=True)
    (broken,) = epoch(s)  # the header of cut.jpg reads: a verifying stream (--skip-bad-samples) would leave it out
    with pytest.raises(UserError, match=r"shard-000001\.tar/s000-000000002: cannot decode image .*\.img0\.jpg"):
        broken.sample(config(), pixels=True)
    assert epoch(stream(tmp_path / "m", skip=True, verify=True)) == []

    conv = [{"role": "user", "content": "<image> and <image>?"}, {"role": "assistant", "content": "one"}]
    write_bridge_folder(tmp_path / "tags", [("k0", conv, png((1, 2, 3)))])
    with pytest.raises(EnergonSampleError, match=r"train-shard-000000\.tar/k0: its conversation has 2 image"):
        epoch(stream(tmp_path / "tags"))

    shard = folder / "train-shard-000000.tar"  # its 4 samples end at byte 8192 (a tar is padded to 10240)
    whole = shard.read_bytes()
    shard.write_bytes(whole[:len(whole) // 2])  # a truncated copy: named before training, by its first lost sample
    with pytest.raises(EnergonDataError, match=r"^train-shard-000000\.tar/s000-00000000[0-3]: the shard ends at byte"):
        check_source(str(folder), "train")
    shard.write_bytes(whole)
    (folder / ".nv-meta" / "dataset.yaml").write_text("__module__: [unclosed\n")
    with pytest.raises(EnergonDataError, match=r"\.nv-meta/dataset\.yaml: unreadable"):
        check_source(str(folder), "train")
    (folder / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: VQAWebdataset\n")
    with pytest.raises(EnergonDataError, match="VQAWebdataset without a field_map"):
        check_source(str(folder), "train")
    prepare(str(folder), "omnibal")
    os.remove(folder / ".nv-meta" / "split.yaml")
    with pytest.raises(EnergonDataError, match=r"\.nv-meta/split\.yaml: not found"):
        check_source(str(folder), "train")


def test_converter_refusals(tmp_path, capsys):
    """What a layout cannot hold is refused naming annotation:line (or listed with skip_bad); the command line
    writes a split and refuses in one line."""
    (tmp_path / "frames").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "frames" / "0.png")
    energon_media.write_coded_video(str(tmp_path / "v.mp4"), 4, 4, 32, 32)
    lines = [{"video": "frames", "conversations": [{"from": "human", "value": "?"}, {"from": "gpt", "value": "a"}]},
             {"video": "v.mp4", "clip": [0, 0.5], "conversations": [{"from": "human", "value": "?"},
                                                                   {"from": "gpt", "value": "b"}]},
             {"image": "gone.png", "conversations": [{"from": "human", "value": "<image>"},
                                                     {"from": "gpt", "value": "c"}]}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ConvertError, match=r"d\.jsonl:1: video .*frames: a frame folder"):
        to_energon(str(path), str(tmp_path / "a"))
    clip = tmp_path / "clip.jsonl"
    clip.write_text(json.dumps(lines[1]) + "\n")
    with pytest.raises(ConvertError, match=r"clip\.jsonl:1: a 'clip': Bridge's layout has no clips"):
        to_energon(str(clip), str(tmp_path / "b"), layout="bridge")
    done = to_energon(str(path), str(tmp_path / "c"), skip_bad=True)
    assert done.samples == {"d": 1} and [s.split(": ")[0].rsplit(":", 1)[1] for s in done.skipped] == ["1", "3"]
    from omnibal_cli import main as omnibal

    # a validation split of the same records into the same folder: its keys differ (Energon refuses a key twice)
    assert omnibal(["data", "to-energon", "--data", str(path), "--out", str(tmp_path / "c"), "--split", "val",
                    "--skip-bad-samples"]) == 0
    out = capsys.readouterr()
    assert f"wrote 1 samples (d: 1) in 1 shard(s), omnibal layout, split 'val' -> {tmp_path / 'c'}" in out.out
    with tarfile.open(tmp_path / "c" / "val-shard-000000.tar") as val, \
            tarfile.open(tmp_path / "c" / "train-shard-000000.tar") as train:
        assert [m.name.split(".")[0] for m in val.getmembers()][0] == "val-s000-000000002"
        assert [m.name.split(".")[0] for m in train.getmembers()][0] == "s000-000000002"
    assert omnibal(["data", "to-energon", "--data", str(path), "--out", str(tmp_path / "x")]) == 1
    assert "omnibal data: error: " in capsys.readouterr().err


def test_video_bytes_and_a_header_without_a_frame_count(tmp_path):
    """A video's bytes decode as its file does; a Matroska file (no frame count in its header) is counted by its
    packets, without decoding."""
    from megatron.vlm.data.video_decode import VideoBytes, decode_frames, probe_video

    path = tmp_path / "v.mkv"
    with av.open(str(path), "w") as out:
        stream_ = out.add_stream("libx264", rate=5)
        stream_.width, stream_.height, stream_.pix_fmt = 32, 32, "yuv420p"
        for k in range(7):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 30 * k, np.uint8), format="rgb24")
            for packet in stream_.encode(frame):
                out.mux(packet)
        for packet in stream_.encode():
            out.mux(packet)
    with av.open(str(path)) as c:
        assert not c.streams.video[0].frames  # the header holds no count
    info = probe_video(str(path))
    in_memory = probe_video(VideoBytes("shard.tar/k.video.mkv", path.read_bytes()))
    assert info.num_frames == in_memory.num_frames == 7 and in_memory.path == "shard.tar/k.video.mkv"
    a = decode_frames(str(path), info, [0, 6]).frames
    b = decode_frames(VideoBytes("x", path.read_bytes()), in_memory, [0, 6]).frames
    assert np.array_equal(a, b)


def test_look_ahead_keeps_its_cost_table_with_its_samples():
    """Samples appended and taken in any order: the buffer's cost arrays stay those of its samples, in their order,
    and ``take`` serves the positions asked in that order (recounted from the samples themselves)."""
    rng = np.random.default_rng(0)
    made = [SimpleNamespace(cost=SampleCost(int(k), int(10 * k), 0.1 * k, 0.2 * k), __restore_key__=("k", k))
            for k in range(200)]
    buffer, expected, served = LookAhead(made[:10]), list(made[:10]), []
    nxt = 10
    for _ in range(30):
        add = int(rng.integers(0, 8))
        buffer.append(made[nxt:nxt + add])
        expected += made[nxt:nxt + add]
        nxt += add
        positions = rng.permutation(len(expected))[:int(rng.integers(0, min(5, len(expected)) + 1))].tolist()
        taken = buffer.take(positions)
        assert taken == [expected[p] for p in positions]
        served += taken
        expected = [s for p, s in enumerate(expected) if p not in set(positions)]
        assert buffer.samples == expected
        assert buffer.costs.tokens.tolist() == [s.cost.tokens for s in expected]
        assert buffer.costs.llm_s.tolist() == [s.cost.llm_s for s in expected]
        assert buffer.restore_keys() == [s.__restore_key__ for s in expected]
    assert sorted(id(s) for s in served + expected) == sorted(id(s) for s in made[:nxt])
    with pytest.raises(ValueError, match="not distinct positions"):
        buffer.take([0, 0])
