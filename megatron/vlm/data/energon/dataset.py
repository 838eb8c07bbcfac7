"""Energon's datasets of chat samples, built with Energon's own machinery and without a Bridge import.

``ChatWebdataset`` is an Energon ``DefaultGenericWebdatasetFactory`` whose sample loader keeps a sample's members as
bytes (``ChatSample``: nothing is decoded in Energon; ``samples.py`` reads them): every member for this trainer's
layout, the ``field_map``'s members for Megatron-Bridge's (``layout.py``).  Its own folders' ``dataset.yaml`` names
it, so Energon's ``get_train_dataset`` loads them too; a Bridge folder's ``dataset.yaml`` names a Bridge class, so
Energon's loader cannot: ``load_datasets`` builds the factory of each folder from its ``field_map`` directly.

``load_datasets(path, split, ...)``: a dataset folder, or a ``MetadatasetV2`` YAML (blends with weights,
``blend_epochized`` with repetitions, nested metadatasets): Energon's ``load_dataset`` reads the YAML and resolves
weights, repetitions and subsets as it defines them; each leaf folder's loader is this module's
(``ChatFolderLoader``).  Joins (``join``) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron.energon import DefaultGenericWebdatasetFactory, Sample, edataclass, load_dataset
from megatron.energon.epathlib import EPath
from megatron.energon.metadataset.dataset_loader import DatasetLoader
from megatron.energon.metadataset.loader_interface import (DatasetBlendMode, DatasetLoaderInterface, LoadedDataset,
                                                           LoadedDatasetList)
from megatron.energon.metadataset.metadataset_v2 import (DatasetReference, MetadatasetBlend, MetadatasetBlendEpochized,
                                                         MetadatasetJoin, MetadatasetV2)

from ..record_sample import ReaderConfig
from .layout import BRIDGE, OMNIBAL, EnergonDataError, FolderLayout, check_prepared, folder_layout


@dataclass(frozen=True)
class EnergonSource:
    """An Energon dataset of a run: ``path`` (a folder or a metadataset YAML), its ``split`` and the reader's
    ``config`` (the family's rules)."""

    path: str
    split: str
    config: ReaderConfig


@edataclass
class ChatSample(Sample):
    """One sample's members as bytes (member name without the key, e.g. ``conversation.json`` -> bytes) and the
    layout of its folder."""

    kind: str
    field_map: dict
    members: dict


@dataclass(frozen=True)
class KeepMembers:
    """The factory's sample loader: a raw WebDataset sample -> ``ChatSample`` fields (picklable)."""

    layout: FolderLayout

    def __call__(self, raw: dict) -> dict:
        return {"kind": self.layout.kind, "field_map": dict(self.layout.field_map),
                "members": {k: v for k, v in raw.items() if not k.startswith("__")}}


@dataclass(frozen=True)
class MemberFilter:
    """The factory's part filter: every member (this trainer's layout), or the ``field_map``'s (Bridge's)."""

    members: frozenset | None

    def __call__(self, part: str) -> bool:
        return self.members is None or part in self.members


class ChatWebdataset(DefaultGenericWebdatasetFactory[ChatSample]):
    """The Energon factory of one dataset folder of either layout (``layout``: None reads the folder's
    ``dataset.yaml``)."""

    __sample_type__ = ChatSample

    def __init__(self, path: EPath, *, layout: FolderLayout | None = None, **kwargs):
        layout = layout if layout is not None else folder_layout(str(path))
        members = None if layout.kind == OMNIBAL else frozenset(layout.field_map.values())
        self.layout = layout
        super().__init__(path, sample_loader=KeepMembers(layout), part_filter=MemberFilter(members), **kwargs)


@edataclass
class ChatFolderLoader(DatasetLoaderInterface):
    """Energon's loader interface for one dataset folder of either layout (a metadataset's leaf, or the whole
    ``--data-path``)."""

    path: Any
    split_part: Optional[str] = None
    subflavors: Optional[dict] = None
    split_config: Optional[str] = None

    def post_initialize(self, mds_path: Optional[EPath] = None):
        pass

    def get_datasets(self, *, training: bool, split_part: str, worker_config, subflavors: Optional[dict] = None,
                     shuffle_over_epochs_multiplier: Optional[int] = 1, subset=None, **kwargs) -> LoadedDatasetList:
        split = self.split_part or split_part
        folder = str(self.path)
        check_prepared(folder, split)
        if self.subflavors is not None:
            subflavors = {**self.subflavors, **(subflavors or {})}
        factory = ChatWebdataset(EPath(folder), layout=folder_layout(folder), split_part=split, training=training,
                                 worker_config=worker_config, subflavors=subflavors,
                                 shuffle_over_epochs=shuffle_over_epochs_multiplier, subset=subset,
                                 split_config=self.split_config)
        return LoadedDatasetList(blend_mode=DatasetBlendMode.NONE, datasets=[LoadedDataset(dataset=factory)])


def _with_chat_leaves(node, where: str):
    """``node`` of a loaded metadataset with every leaf folder's loader replaced by a ``ChatFolderLoader``."""
    if isinstance(node, DatasetLoader):
        return ChatFolderLoader(path=node.path, split_part=node.split_part, subflavors=node.subflavors,
                                split_config=node.split_config)
    if isinstance(node, MetadatasetJoin) or type(node).__name__.startswith(("Join", "BlendJoin", "BlendEpochizedJoin")):
        raise EnergonDataError(f"{where}: a 'join' of datasets is not read by this trainer (blend or blend_epochized "
                               "whole samples instead)")
    if isinstance(node, MetadatasetV2):
        for name, split in node.splits.items():
            node.splits[name] = _with_chat_leaves(split, where)
        return node
    if isinstance(node, DatasetReference):
        if node.aux:
            raise EnergonDataError(f"{where}: {node.path}: auxiliary datasets (aux) are not read by this trainer")
        node._dataset = _with_chat_leaves(node._dataset, where)
        return node
    if isinstance(node, MetadatasetBlend):
        node.blend = [_with_chat_leaves(d, where) for d in node.blend]
        return node
    if isinstance(node, MetadatasetBlendEpochized):
        node.blend_epochized = [_with_chat_leaves(d, where) for d in node.blend_epochized]
        return node
    raise EnergonDataError(f"{where}: {type(node).__name__} is not read by this trainer (a MetadatasetV2 of dataset "
                           "folders, blend or blend_epochized)")


def dataset_loader(path: str) -> DatasetLoaderInterface:
    """Energon's loader of ``path``: a dataset folder, or a ``MetadatasetV2`` YAML whose leaves are read as chat
    folders; refuses what Energon cannot load, naming ``path``."""
    if not path.endswith((".yaml", ".yml")):
        return ChatFolderLoader(path=EPath(path))
    try:
        loaded = load_dataset(path)
    except EnergonDataError:
        raise
    except Exception as e:  # noqa: BLE001 - a YAML Energon refuses: this file's problem
        raise EnergonDataError(f"{path}: not a metadataset Energon loads ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:300]})") from None
    if not isinstance(loaded, MetadatasetV2):
        raise EnergonDataError(f"{path}: a {type(loaded).__name__}; this trainer reads MetadatasetV2 YAMLs "
                               "(__module__: megatron.energon, __class__: MetadatasetV2)")
    return _with_chat_leaves(loaded, path)


def load_datasets(path: str, split: str, worker_config, training: bool) -> LoadedDatasetList:
    """The factories (with their weights or repetitions) of ``split`` of ``path`` for one data-parallel rank."""
    loader = dataset_loader(path)
    if path.endswith((".yaml", ".yml")) and split not in loader.splits:
        raise EnergonDataError(f"{path}: has no split {split!r} (splits: {', '.join(sorted(loader.splits))})")
    return loader.get_datasets(training=training, split_part=split, worker_config=worker_config)


__all__ = ["BRIDGE", "OMNIBAL", "ChatFolderLoader", "ChatSample", "ChatWebdataset", "EnergonSource",
           "dataset_loader", "load_datasets"]
