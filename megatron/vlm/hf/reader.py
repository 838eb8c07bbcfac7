"""The safetensors shards of a Hugging Face model folder, read lazily (one tensor, or a slice of one)."""
from __future__ import annotations

import glob
import json
import os

import torch

from .config import HFConfigError


class HFCheckpoint:
    """Tensor names -> shard files of ``folder`` (``model.safetensors.index.json`` or every
    ``*.safetensors``); tensors are read on demand, each file opened once."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise HFConfigError(f"--hf-checkpoint {folder}: {index} is not a safetensors index ({e!r})") from None
            self.files = {k: os.path.join(folder, v) for k, v in weight_map.items()}
        else:
            self.files = {}
            for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
                with self._open_file(path) as f:
                    for k in f.keys():
                        self.files[k] = path
        if not self.files:
            raise HFConfigError(f"--hf-checkpoint {folder}: no *.safetensors weights there (PyTorch .bin "
                                "checkpoints are not read: convert them with save_pretrained(safe_serialization=True))")
        self._open: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def _open_file(self, path: str):
        """``safe_open`` of one shard; a missing, truncated or damaged file is refused, naming it."""
        from safetensors import SafetensorError, safe_open  # optional (the hf extra): only HF folders need it

        try:
            return safe_open(path, "pt")
        except (SafetensorError, OSError) as e:
            raise HFConfigError(f"--hf-checkpoint {self.folder}: {path} is not a readable safetensors file ({e}): "
                                "truncated or damaged? fetch it again") from None

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._open_file(path)
        return self._open[path]

    def release(self) -> None:
        """Close the open shards: unmaps the pages read so far (they count in the process's resident memory
        while mapped); the next read reopens its shard."""
        self._open.clear()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._handle(name).get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def box(self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows [r0, r1) (and columns [c0, c1) when given) of the tensor; only those are read."""
        sl = self._handle(name).get_slice(name)
        if cols is None:
            return sl[rows[0]:rows[1]]
        return sl[rows[0]:rows[1], cols[0]:cols[1]]

    def block(self, name: str, index: int, rows: tuple[int, int], transposed: bool = False) -> torch.Tensor:
        """Rows [r0, r1) of ``tensor[index]`` (a 3-D tensor of stacked blocks); ``transposed``: its columns
        [r0, r1), returned as rows. Only those are read."""
        sl = self._handle(name).get_slice(name)
        if transposed:
            return sl[index:index + 1, :, rows[0]:rows[1]][0].t()
        return sl[index:index + 1, rows[0]:rows[1]][0]
