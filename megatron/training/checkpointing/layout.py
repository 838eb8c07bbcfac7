"""Where checkpoints live under a --save/--load folder: Megatron's ``iter_NNNNNNN`` folders and tracker file."""
from __future__ import annotations

import dataclasses
import os
import re

from omnibal_ext.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"  # the newest complete iteration, written last
MANIFEST = "omnibal_manifest.json"  # in iter_N/: size and XXH3-64 of every other file
FORMAT = "omnibal-torch_dist-1"  # run["format"] in the common state
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


class CheckpointError(UserError):
    """A --load folder that this run cannot resume from; the message names the file or tensor."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint found under --load."""

    root: str
    iteration: int

    @property
    def path(self) -> str:
        return iteration_dir(self.root, self.iteration)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete_iterations(root: str) -> list[int]:
    """Iterations of the complete (renamed) checkpoint folders under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := _ITER_DIR.match(name)))
