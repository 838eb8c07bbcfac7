"""Crash-safe files: fsynced atomic writes, and the size + XXH3-64 manifest that a load checks first."""
from __future__ import annotations

import json
import mmap
import os

import torch.distributed as dist
import xxhash

from .layout import MANIFEST, Checkpoint


def hash_files(folder: str) -> dict:
    """{file: [bytes, XXH3-64]} of every file under ``folder``, each rank hashing (and fsyncing: megatron-core's
    common files are not) its share of the files."""
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    mine = {}
    for name in files[dist.get_rank()::dist.get_world_size()]:
        path = os.path.join(folder, name)
        _fsync_file(path)
        mine[name] = [os.path.getsize(path), digest(path)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {f: v for part in everyone for f, v in sorted(part.items())}


def digest(path: str) -> int:
    """XXH3-64 of a file's bytes (read through a memory map: ~25 GB/s from the page cache, 10x zlib's CRC32
    read in chunks, measured)."""
    if os.path.getsize(path) == 0:
        return xxhash.xxh3_64_intdigest(b"")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return xxhash.xxh3_64_intdigest(data)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file, fsync, rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_json(path: str, obj) -> None:
    write_text(path, json.dumps(obj, indent=1))


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_files(ckpt: Checkpoint) -> list[str]:
    """Problems with the checkpoint's files (every rank checks its share of the checksums; all ranks agree)."""
    folder = ckpt.path
    if not os.path.isdir(folder):
        problems = [f"{folder} does not exist"]
    else:
        problems = sizes_problems(folder)
    if not problems:
        with open(os.path.join(folder, MANIFEST)) as f:
            files = json.load(f)["files"]
        for name in sorted(files)[dist.get_rank()::dist.get_world_size()]:
            if digest(os.path.join(folder, name)) != files[name][1]:
                problems.append(f"{os.path.join(folder, name)} is corrupt (its XXH3 checksum differs from the one saved)")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return sorted({p for part in everyone for p in part})


def sizes_problems(folder: str) -> list[str]:
    """Missing manifest, missing files and files of the wrong size (cheap: no data read)."""
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.exists(manifest):
        return [f"{manifest} is missing (the save did not finish)"]
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return [f"{manifest} is unreadable ({e})"]
    problems = []
    for name, (size, _) in sorted(files.items()):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{path} has {os.path.getsize(path)} bytes, {size} were saved (truncated?)")
    return problems
