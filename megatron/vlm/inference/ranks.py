"""Rank 0 leads, the other ranks of the layout follow: each batch rank 0 is about to generate is broadcast to every
rank first, so that all of them call the (collective) generator with the same requests.

The batches travel on a gloo group of their own with a long timeout: a follower waits in that broadcast for as
long as the server is idle, which the training group's timeout (minutes) would cut short.  ``None`` tells the
followers to return.  A world of one has no group and nothing to send.

A request names its media by paths on rank 0's machine (the client's local paths, or the files its data URLs were
written to).  Ranks on other hosts cannot open those, so when the world spans several hosts the media's bytes travel
with the batch (a frame folder's frames too), and each follower writes them to a folder of its own and reads the
requests with those paths; on one host the paths are shared as they are.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from megatron.vlm.inference.requests import GenerationRequest, GenerationResult, Generator

IDLE_TIMEOUT = datetime.timedelta(days=30)  # how long a follower waits for the next batch
MEDIA_TYPES = ("image", "video")  # structured parts naming a file: by their type, "url" or "path" (messages.py)


@dataclass(frozen=True)
class Parcel:
    """One batch as sent: its requests and, across hosts, every medium's bytes by the path rank 0 knows it by (a
    frame folder: ``{frame file name: bytes}``)."""

    requests: tuple[GenerationRequest, ...]
    media: dict[str, bytes | dict[str, bytes]]


def media_paths(request: GenerationRequest) -> list[str]:
    """The paths a request's media are read from: its image and video parts, then its ``images`` and ``videos``."""
    paths = []
    for message in request.messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            key = _path_key(part)
            if key is not None:
                paths.append(part[key])
    return paths + list(request.images) + list(request.videos)


def _path_key(part) -> str | None:
    """The key of a media part's path (None: not a media part)."""
    if not isinstance(part, dict) or part.get("type") not in MEDIA_TYPES:
        return None
    return next(key for key in (part["type"], "url", "path") if key in part)


def pack(requests: Sequence[GenerationRequest], with_media: bool) -> Parcel:
    media: dict[str, bytes | dict[str, bytes]] = {}
    for path in (p for r in requests for p in media_paths(r)) if with_media else ():
        if path in media:
            continue
        if os.path.isdir(path):
            media[path] = {name: _read(os.path.join(path, name)) for name in sorted(os.listdir(path))
                           if os.path.isfile(os.path.join(path, name))}
        else:
            media[path] = _read(path)
    return Parcel(tuple(requests), media)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def unpack(parcel: Parcel, folder: str) -> list[GenerationRequest]:
    """The parcel's requests, their media written under ``folder`` and named there."""
    local = {}
    for k, (path, data) in enumerate(parcel.media.items()):
        target = os.path.join(folder, f"{k}_{os.path.basename(path.rstrip('/')) or 'medium'}")
        if isinstance(data, dict):
            os.makedirs(target)
            for name, frame in data.items():
                with open(os.path.join(target, name), "wb") as f:
                    f.write(frame)
        else:
            with open(target, "wb") as f:
                f.write(data)
        local[path] = target
    if not local:
        return list(parcel.requests)
    return [_renamed(r, local) for r in parcel.requests]


def _renamed(request: GenerationRequest, local: dict[str, str]) -> GenerationRequest:
    messages = []
    for message in request.messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [part if (key := _path_key(part)) is None else {**part, key: local[part[key]]}
                       for part in content]
        messages.append({**message, "content": content})
    return dataclasses.replace(request, messages=tuple(messages), images=tuple(local[p] for p in request.images),
                               videos=tuple(local[p] for p in request.videos))


class BatchChannel:
    """The broadcast of batches from rank 0.  Collective to build (every rank, after the process group)."""

    def __init__(self) -> None:
        self._group = None
        self.across_hosts = False
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            hosts = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname(), group=self._group)
            self.across_hosts = len(set(hosts)) > 1

    @property
    def is_leader(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def send(self, requests: Sequence[GenerationRequest] | None) -> None:
        """Rank 0: give ``requests`` (None: stop) to every other rank."""
        if self._group is not None:
            parcel = None if requests is None else pack(requests, self.across_hosts)
            dist.broadcast_object_list([parcel], src=0, group=self._group)

    def receive(self) -> Parcel | None:
        """Another rank: the next batch (None: stop), waiting as long as it takes."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


class LeaderGenerator:
    """Rank 0's generator: sends each batch to the followers, then generates it with them."""

    def __init__(self, generator: Generator, channel: BatchChannel):
        self._generator, self._channel = generator, channel

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Callable[[int, int, str], None] | None = None) -> list[GenerationResult]:
        self._channel.send(requests)
        return self._generator.generate(requests, on_token)

    def release(self) -> None:
        """Tell the followers to return."""
        self._channel.send(None)


def follow(generator: Generator, channel: BatchChannel) -> int:
    """A rank other than 0: generate each batch rank 0 sends, until it says stop; returns the batches served.  A
    batch that raises is reported and passed over, as rank 0 passes over its failed batches (the same requests
    fail the same way on every rank)."""
    served = 0
    while (parcel := channel.receive()) is not None:
        folder = tempfile.mkdtemp(prefix="omnibal-serve-rank-") if parcel.media else None
        try:
            generator.generate(unpack(parcel, folder) if folder else list(parcel.requests))
        except Exception as e:  # noqa: BLE001 - rank 0 answers the clients; this rank goes on following
            print(f"rank {dist.get_rank()}: a batch failed ({type(e).__name__}: {e}); following on", file=sys.stderr,
                  flush=True)
        finally:
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
        served += 1
    return served
