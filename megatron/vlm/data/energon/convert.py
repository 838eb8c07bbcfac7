"""``omnibal data to-energon``: a meta JSON or annotation JSONL (images, videos, both record formats) -> Energon
WebDataset shards, indexed with Energon's own preparation API, in this trainer's layout or Megatron-Bridge's.

Each record becomes one sample, keyed ``s<source>-<line>`` (its annotation and 1-based line; ``<split>-s...``
outside the train split), in shards ``<split>-shard-000000.tar`` of ``samples_per_shard`` samples, records in file
order.  Its media files become members:

* ``omnibal`` layout: ``<key>.record.json`` is the record as written, its image paths replaced by member names
  (``img0.jpg``, ``img1.png``: the file's extension kept) and its video paths by ``vid0.mp4``, plus
  ``omnibal_origin`` = ``[source, line]`` (what seeds a family's video draws, so a converted sample draws the frames
  the JSONL path draws); ``clip`` and everything else kept.
* ``bridge`` layout (Megatron-Bridge's ``ChatMLWebdataset``): ``<key>.conversation.json`` is a ChatML list of
  ``role``/``content`` messages whose images and videos are path-less typed parts (``{"type": "image"}``,
  ``{"type": "video"}``) in reading order, the record's turns as the reader parses them (missing placeholders added
  as the JSONL path adds them); ``<key>.jpgs`` the pickled list of its images' bytes, ``<key>.video.mp4`` its video
  (one at most; a clip is refused: Bridge's layout has none).

Then ``.nv-meta/`` is written by ``BaseWebdatasetFactory.prepare_dataset`` (every split found among the folder's
shards: a validation set converted with ``split="val"`` into the same folder joins it) and ``dataset.yaml`` names
this trainer's factory, or Bridge's with ``field_map {conversation: conversation.json, imgs: jpgs, videos:
video.mp4}``.  A meta JSON of several sources is written as one folder per source plus ``metadataset.yaml``, a
``MetadatasetV2`` ``blend_epochized`` whose repetitions are the sources' ``repeat_time`` (Energon's repetitions:
a fraction repeats a random part of a source each epoch).

Refused, naming ``annotation:line``: a record the reader refuses to parse, a missing media file, a video that is a
frame folder; with ``skip_bad`` such records are left out and listed in the result.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import tarfile
from dataclasses import dataclass, field

import yaml
from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

from omnibal_ext.errors import UserError

from ..messages import IMAGE_TAG, VIDEO_TAG
from ..record_sample import RecordVideo, record_turns
from ..records import SourceSpec, read_meta
from .encoder import ORIGIN_KEY
from .layout import BRIDGE, DATASET_YAML, META, OMNIBAL, OWN_CLASS, OWN_MODULE, RECORD_MEMBER

BRIDGE_FIELD_MAP = {"conversation": "conversation.json", "imgs": "jpgs", "videos": "video.mp4"}
BRIDGE_MODULE = "megatron.bridge.data.energon.task_encoder_utils"
METADATASET = "metadataset.yaml"
_TAGS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")
_SHARD = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-shard-\d+\.tar$")


class ConvertError(UserError):
    """A record or an output ``to-energon`` cannot convert; the message names it."""


@dataclass
class Converted:
    """What a conversion wrote: ``path`` (the dataset folder, or the metadataset YAML of several), ``samples`` per
    source, ``shards`` written, ``skipped`` records (``annotation:line: reason``)."""

    path: str
    samples: dict = field(default_factory=dict)
    shards: int = 0
    skipped: list = field(default_factory=list)


def sample_key(split: str, source: int, line: int) -> str:
    """The key of the record at ``line`` (1-based) of source ``source`` in ``split``: ``s<source>-<line>``, prefixed
    with ``<split>-`` outside the train split (Energon refuses a key twice in one folder, and a validation split is
    often converted from the same records into the same folder)."""
    key = f"s{source:03d}-{line:09d}"
    return key if split == "train" else f"{split}-{key}"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _ext(path: str, default: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return ext if ext and "." not in ext else default


def _checked_media(images: list[str], videos: list[RecordVideo], root: str) -> tuple[list[str], list[str]]:
    """(image files, video files) of a record, each checked to exist (a video: a file, not a frame folder)."""
    image_files = [os.path.join(root, p) for p in images]
    for path in image_files:
        if not os.path.isfile(path):
            raise ConvertError(f"image file not found: {path}")
    video_files = [os.path.join(root, v.path) for v in videos]
    for path in video_files:
        if os.path.isdir(path):
            raise ConvertError(f"video {path}: a frame folder; to-energon stores video files only (encode the frames "
                               "into a video file first)")
        if not os.path.isfile(path):
            raise ConvertError(f"video {path}: no such file")
    return image_files, video_files


def omnibal_sample(record: dict, root: str, origin: tuple[int, int]) -> dict:
    """The members of a record in this trainer's layout (see the module docstring)."""
    turns, images, videos = record_turns(record)
    image_files, video_files = _checked_media(images, videos, root)
    members, names = {}, {}
    for k, path in enumerate(image_files):
        name = f"img{k}.{_ext(path, 'img')}"
        members[name], names[("image", images[k])] = _read(path), name
    for k, path in enumerate(video_files):
        name = f"vid{k}.{_ext(path, 'mp4')}"
        members[name], names[("video", videos[k].path)] = _read(path), name
    members[RECORD_MEMBER] = json.dumps({**_renamed(record, names), ORIGIN_KEY: list(origin)}).encode()
    return members


def _renamed(record: dict, names: dict) -> dict:
    """``record`` with its media paths replaced by member names (``names``: (kind, path) -> member)."""
    out = dict(record)
    if "messages" in record:
        for key, kind in (("images", "image"), ("videos", "video")):
            paths = record.get(key)
            if isinstance(paths, str):
                paths = [paths]
            if paths:
                out[key] = [names[(kind, p)] for p in paths]
        out["messages"] = [_renamed_message(m, names) for m in record["messages"]]
        return out
    image = record.get("image")
    if isinstance(image, str) and image:
        out["image"] = names[("image", image)]
    elif isinstance(image, list):
        out["image"] = [names[("image", p)] for p in image]
    if record.get("video"):
        out["video"] = names[("video", record["video"])]
    return out


def _renamed_message(message: dict, names: dict) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("image", "video"):
            kind = part["type"]
            keys = ("image", "url", "path") if kind == "image" else ("video", "url", "path")
            path = next(part[k] for k in keys if k in part)
            part = {"type": kind, kind: names[(kind, path)]}
        parts.append(part)
    return {**message, "content": parts}


def bridge_sample(record: dict, root: str) -> dict:
    """The members of a record in Megatron-Bridge's layout (see the module docstring)."""
    turns, images, videos = record_turns(record)
    if len(videos) > 1:
        raise ConvertError(f"{len(videos)} videos: Bridge's layout holds one video per sample (video.mp4)")
    if any(v.clip_s is not None for v in videos):
        raise ConvertError("a 'clip': Bridge's layout has no clips (cut the video file, or use the omnibal layout)")
    image_files, video_files = _checked_media(images, videos, root)
    conversation = []
    for turn in turns:
        if turn.role == "user" and _TAGS.search(turn.text):
            content = [{"type": "image"} if p == IMAGE_TAG else {"type": "video"} if p == VIDEO_TAG
                       else {"type": "text", "text": p} for p in _TAGS.split(turn.text) if p]
        elif turn.role == "system":
            content = turn.text
        else:
            content = [{"type": "text", "text": turn.text}]
        conversation.append({"role": turn.role, "content": content})
    members = {BRIDGE_FIELD_MAP["conversation"]: json.dumps(conversation).encode()}
    if image_files:
        members[BRIDGE_FIELD_MAP["imgs"]] = pickle.dumps([_read(p) for p in image_files])
    if video_files:
        members[BRIDGE_FIELD_MAP["videos"]] = _read(video_files[0])
    return members


class ShardWriter:
    """Tar shards ``<split>-shard-NNNNNN.tar`` of ``per_shard`` samples each under ``folder``."""

    def __init__(self, folder: str, split: str, per_shard: int):
        self.folder, self.split, self.per_shard = folder, split, per_shard
        self.names: list[str] = []
        self._tar = None
        self._count = 0

    def write(self, key: str, members: dict) -> None:
        if self._tar is None or self._count == self.per_shard:
            self.close()
            name = f"{self.split}-shard-{len(self.names):06d}.tar"
            self.names.append(name)
            self._tar = tarfile.open(os.path.join(self.folder, name), "w")
            self._count = 0
        for member, data in sorted(members.items()):
            info = tarfile.TarInfo(f"{key}.{member}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            self._tar.addfile(info, io.BytesIO(data))
        self._count += 1

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None


def prepare(folder: str, layout: str, workers: int = 1) -> None:
    """Index every ``<split>-shard-*.tar`` of ``folder`` with Energon's preparation API and write ``dataset.yaml``."""
    shards = sorted(n for n in os.listdir(folder) if _SHARD.match(n))
    if not shards:
        raise ConvertError(f"{folder}: no <split>-shard-NNNNNN.tar shard to index")
    splits = sorted({_SHARD.match(n).group("split") for n in shards})
    BaseWebdatasetFactory.prepare_dataset(folder, shards, split_parts_patterns=[(s, f"{s}-shard-.*") for s in splits],
                                          workers=workers, shuffle_seed=None)
    config = {"__module__": OWN_MODULE, "__class__": OWN_CLASS} if layout == OMNIBAL else \
        {"__module__": BRIDGE_MODULE, "__class__": "ChatMLWebdataset", "field_map": dict(BRIDGE_FIELD_MAP),
         "subflavors": {}}
    with open(os.path.join(folder, META, DATASET_YAML), "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)


def convert_source(src: SourceSpec, s_idx: int, folder: str, layout: str, split: str, per_shard: int,
                   skip_bad: bool, skipped: list) -> tuple[int, list[str]]:
    """Write one annotation's records as shards of ``split`` in ``folder``; (samples written, shard names)."""
    os.makedirs(folder, exist_ok=True)
    stale = [n for n in os.listdir(folder) if n.startswith(f"{split}-shard-") and n.endswith(".tar")]
    for name in stale:  # a conversion of the same split again replaces it
        os.remove(os.path.join(folder, name))
    writer, count = ShardWriter(folder, split, per_shard), 0
    try:
        with open(src.annotation, "rb") as f:
            for line, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                where = f"{src.annotation}:{line}"
                try:
                    try:
                        record = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise ConvertError(f"not valid JSON ({getattr(e, 'msg', e)})") from None
                    members = (omnibal_sample(record, src.root, (s_idx, line)) if layout == OMNIBAL
                               else bridge_sample(record, src.root))
                except UserError as e:
                    if not skip_bad:
                        raise ConvertError(f"{where}: {e}") from None
                    skipped.append(f"{where}: {e}")
                    continue
                writer.write(sample_key(split, s_idx, line), members)
                count += 1
    finally:
        writer.close()
    if not count:
        raise ConvertError(f"{src.annotation}: no record to convert" + (" (every record skipped)" if skipped else ""))
    return count, writer.names


def to_energon(data: str, out: str, layout: str = OMNIBAL, split: str = "train", samples_per_shard: int = 1000,
               skip_bad: bool = False, workers: int = 1) -> Converted:
    """Convert the meta JSON or annotation JSONL ``data`` into Energon shards under ``out`` (module docstring)."""
    if layout not in (OMNIBAL, BRIDGE):
        raise ConvertError(f"layout {layout!r}: expected {OMNIBAL!r} or {BRIDGE!r}")
    if not re.fullmatch(r"[A-Za-z0-9_]+", split):
        raise ConvertError(f"split {split!r}: letters, digits and '_' only (it names the shards)")
    if samples_per_shard < 1:
        raise ConvertError(f"samples per shard must be >= 1, got {samples_per_shard}")
    sources = read_meta(data)
    if len(sources) == 1 and sources[0].repeat_time != 1:
        raise ConvertError(f"{data}: repeat_time {sources[0].repeat_time} of its one source: Energon repeats a "
                           "metadataset's sources, not a folder; give it a second source or repeat it in training")
    result = Converted(out)
    folders = [out] if len(sources) == 1 else [os.path.join(out, _folder_name(s.name)) for s in sources]
    for s_idx, (src, folder) in enumerate(zip(sources, folders)):
        count, shards = convert_source(src, s_idx, folder, layout, split, samples_per_shard, skip_bad,
                                       result.skipped)
        prepare(folder, layout, workers)
        result.samples[src.name], result.shards = count, result.shards + len(shards)
    if len(sources) > 1:
        result.path = os.path.join(out, METADATASET)
        blend = [{"repetitions": s.repeat_time, "path": os.path.relpath(f, out)} for s, f in zip(sources, folders)]
        with open(result.path, "w") as f:
            yaml.safe_dump({"__module__": "megatron.energon", "__class__": "MetadatasetV2",
                            "splits": {split: {"blend_epochized": blend}}}, f, sort_keys=False)
    return result


def _folder_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "source"
