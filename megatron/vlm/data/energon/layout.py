"""Energon dataset folders on disk: which layout a folder holds, read from its ``.nv-meta/`` before any sample is.

An Energon dataset folder holds WebDataset tar shards and ``.nv-meta/``: ``.info.json`` (samples per shard),
``split.yaml`` (the shards of each split), ``index.sqlite`` (every member's offset; ``energon prepare`` writes these
three) and ``dataset.yaml`` (how a sample's members become a sample).  Two layouts are read, told apart by
``dataset.yaml``:

* **Megatron-Bridge's** (``BRIDGE``): ``dataset.yaml`` names Bridge's ``ChatMLWebdataset`` with a ``field_map``
  from its sample fields to member names, e.g. ``{conversation: conversation.json, imgs: jpgs}``.  Bridge is not
  installed here and its class is never imported: the ``field_map`` alone says where the conversation (a ChatML
  list, ``conversation``), the images (``imgs``: one image member such as ``image.png``, or a pickled list of
  image bytes such as ``jpgs``) and the video (``videos``: one video file member such as ``video.mp4``) are.
* **This trainer's own** (``OMNIBAL``, what ``omnibal data to-energon`` writes): ``dataset.yaml`` names
  ``megatron.vlm.data.energon.dataset.ChatWebdataset``; each sample holds ``<key>.record.json``, a record exactly
  as in a JSONL annotation (``conversations`` or ``messages``) whose image and video paths are the sample's member
  names (``img0.jpg``, ``vid0.mp4``), and those members.

Anything else (a ``dataset.yaml`` of another sample type, a missing or unreadable file of ``.nv-meta/``) is refused
with a ``UserError`` naming the file.  A metadataset (``MetadatasetV2`` YAML) is a YAML file whose leaves are such
folders (``dataset.py`` loads it).
"""
from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field

import yaml
from megatron.energon.epathlib import EPath
from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

from omnibal_ext.errors import UserError

META = ".nv-meta"
DATASET_YAML = "dataset.yaml"
RECORD_MEMBER = "record.json"  # this trainer's layout: the record's member (``<key>.record.json``)
BRIDGE_CLASS = "ChatMLWebdataset"
BRIDGE = "bridge"
OMNIBAL = "omnibal"
OWN_MODULE = "megatron.vlm.data.energon.dataset"
OWN_CLASS = "ChatWebdataset"
BRIDGE_FIELDS = ("conversation", "imgs", "videos")  # the ChatML sample fields a field_map may name


class EnergonDataError(UserError):
    """An Energon dataset this trainer cannot read; the message names the file, shard or sample."""


def is_energon_path(path: str) -> bool:
    """Whether ``path`` is an Energon dataset folder (it holds ``.nv-meta/``) or a metadataset YAML."""
    return os.path.isdir(os.path.join(path, META)) or (os.path.isfile(path) and path.endswith((".yaml", ".yml")))


@dataclass(frozen=True)
class FolderLayout:
    """How the samples of one dataset folder are laid out: ``kind`` (``BRIDGE`` or ``OMNIBAL``) and, for Bridge's,
    the ``field_map`` (sample field -> member name, e.g. ``{"conversation": "conversation.json", "imgs": "jpgs"}``)."""

    kind: str
    field_map: dict = field(default_factory=dict)

    @property
    def record_member(self) -> str:
        """The member holding the conversation (Bridge's) or the record (ours)."""
        return self.field_map["conversation"] if self.kind == BRIDGE else RECORD_MEMBER

    def config(self) -> dict:
        """What Energon's savable-loader configuration records of it."""
        return {"kind": self.kind, "field_map": dict(self.field_map)}


def _meta_file(folder: str, name: str) -> str:
    return os.path.join(folder, META, name)


def read_dataset_yaml(folder: str) -> dict:
    """``.nv-meta/dataset.yaml`` of ``folder`` as a mapping, or a ``EnergonDataError`` naming the file."""
    path = _meta_file(folder, DATASET_YAML)
    if not os.path.isfile(path):
        raise EnergonDataError(f"{path}: not found: an Energon dataset folder needs .nv-meta/{DATASET_YAML} "
                               "(Megatron-Bridge's ChatMLWebdataset with a field_map, or `omnibal data to-energon`'s)")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise EnergonDataError(f"{path}: unreadable ({' '.join(str(e).split())})") from None
    if not isinstance(config, dict):
        raise EnergonDataError(f"{path}: expected a mapping with __module__/__class__, got {type(config).__name__}")
    return config


def folder_layout(folder: str) -> FolderLayout:
    """The layout of the dataset folder ``folder`` (see the module docstring), from its ``dataset.yaml``."""
    config = read_dataset_yaml(folder)
    path = _meta_file(folder, DATASET_YAML)
    module, cls = config.get("__module__"), config.get("__class__")
    if module == OWN_MODULE and cls == OWN_CLASS:
        return FolderLayout(OMNIBAL)
    field_map = config.get("field_map")
    if field_map is None:
        raise EnergonDataError(
            f"{path}: names {module}.{cls} without a field_map; this trainer reads Megatron-Bridge's "
            f"{BRIDGE_CLASS} layout (a field_map naming the conversation and media members) or "
            f"`omnibal data to-energon`'s ({OWN_MODULE}.{OWN_CLASS})")
    if not isinstance(field_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in field_map.items()):
        raise EnergonDataError(f"{path}: field_map must map sample fields to member names, got {field_map!r}")
    unknown = sorted(set(field_map) - set(BRIDGE_FIELDS))
    if unknown:
        raise EnergonDataError(f"{path}: field_map names {', '.join(unknown)}: this trainer reads the ChatML fields "
                               f"{', '.join(BRIDGE_FIELDS)} (audio is not implemented)")
    if "conversation" not in field_map:
        raise EnergonDataError(f"{path}: field_map has no 'conversation' (the ChatML conversation member)")
    for name, member in field_map.items():
        if "[" in member or "/" in member:
            raise EnergonDataError(f"{path}: field_map {name}: {member!r}: this trainer reads whole members "
                                   "(no json[field] access)")
    return FolderLayout(BRIDGE, dict(field_map))


def check_prepared(folder: str, split: str) -> None:
    """Refuse a folder whose ``.nv-meta`` is not what ``energon prepare`` writes, or whose ``split`` is empty, naming
    the file: ``.info.json`` (or ``.info.yaml``), ``split.yaml`` (or ``split.json``) and ``index.sqlite`` readable."""
    meta = os.path.join(folder, META)
    for names in ((".info.json", ".info.yaml"), ("split.yaml", "split.json"), ("index.sqlite",)):
        if not any(os.path.isfile(os.path.join(meta, n)) for n in names):
            raise EnergonDataError(f"{os.path.join(meta, names[0])}: not found; index the shards with `energon "
                                   "prepare` (or `omnibal data to-energon`, which does)")
    try:
        found = WebdatasetMeta.from_config(EPath(folder), split_part=split)
    except Exception as e:  # noqa: BLE001 - Energon raises many kinds on a bad file: each is this folder's problem
        raise EnergonDataError(f"{meta}: unreadable split {split!r} ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:300]})") from None
    if not found.shards or not sum(s.count for s in found.shards):
        raise EnergonDataError(f"{meta}: split {split!r} holds no sample (its split.yaml names no shard of it)")
    check_shards_whole(folder)


def check_shards_whole(folder: str) -> None:
    """Refuse a shard that is missing or shorter than its index says (a truncated copy), naming the shard and the
    first sample whose bytes lie past its end (``.nv-meta/index.sqlite``: each sample's byte range; ``.info.json``:
    the shards in index order)."""
    meta = os.path.join(folder, META)
    info = os.path.join(meta, ".info.json")
    if not os.path.isfile(info):
        return  # a legacy .info.yaml: Energon's own checks only
    problem = None
    try:
        with open(info) as f:
            shards = list(json.load(f)["shard_counts"])
        with sqlite3.connect(f"file:{os.path.join(meta, 'index.sqlite')}?mode=ro", uri=True) as db:
            ends = dict(db.execute("SELECT tar_file_id, MAX(byte_offset + byte_size) FROM samples "
                                   "GROUP BY tar_file_id").fetchall())
            for k, shard in enumerate(shards):
                path = os.path.join(folder, shard)
                if not os.path.isfile(path):
                    problem = f"{path}: not found (.nv-meta/.info.json lists it)"
                    break
                size = os.path.getsize(path)
                if ends.get(k, 0) > size:
                    (key,) = db.execute("SELECT sample_key FROM samples WHERE tar_file_id = ? AND "
                                        "byte_offset + byte_size > ? ORDER BY sample_index LIMIT 1", (k, size)).fetchone()
                    problem = (f"{shard}/{key}: the shard ends at byte {size}, before this sample's data (indexed up "
                               f"to byte {ends[k]}): a truncated shard; copy it again or re-index the folder with "
                               "`energon prepare`")
                    break
    except (OSError, KeyError, ValueError, sqlite3.Error) as e:
        problem = f"{meta}: unreadable index ({type(e).__name__}: {' '.join(str(e).split())})"
    if problem:
        raise EnergonDataError(problem)
