"""Rank 0 leads, the other ranks of the layout follow: each batch rank 0 is about to generate is broadcast to every
rank first, so that all of them call the (collective) generator with the same requests.

The batches travel on a gloo group of their own with a long timeout: a follower waits in that broadcast for as
long as the server is idle, which the training group's timeout (minutes) would cut short.  ``None`` tells the
followers to return.  A world of one has no group and nothing to send.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch.distributed as dist

from megatron.vlm.inference.requests import GenerationRequest, GenerationResult, Generator

IDLE_TIMEOUT = datetime.timedelta(days=30)  # how long a follower waits for the next batch


class BatchChannel:
    """The broadcast of batches from rank 0.  Collective to build (every rank, after the process group)."""

    def __init__(self) -> None:
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    @property
    def is_leader(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def send(self, requests: Sequence[GenerationRequest] | None) -> None:
        """Rank 0: give ``requests`` (None: stop) to every other rank."""
        if self._group is not None:
            dist.broadcast_object_list([None if requests is None else list(requests)], src=0, group=self._group)

    def receive(self) -> list[GenerationRequest] | None:
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
    """A rank other than 0: generate each batch rank 0 sends, until it says stop; returns the batches served."""
    served = 0
    while (requests := channel.receive()) is not None:
        generator.generate(requests)
        served += 1
    return served
