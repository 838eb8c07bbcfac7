"""Concurrent requests gathered into batches for one generator.

The HTTP side ``put``s a ``Ticket`` per request; one thread (the server process's main thread, which also drives
the other ranks) loops in ``run_batches``: it waits for a ticket, takes every ticket waiting then (at most
``max_batch_size``), generates them together, and hands each its result.  Requests that arrive while a batch runs
wait for the next one.  At most ``max_waiting`` tickets wait; one more is refused (``QueueFull``), so a burst
is answered at once rather than piling up without bound.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron.vlm.inference.requests import GenerationRequest, GenerationResult
from omnibal_ext.errors import UserError

GenerateFn = Callable[[Sequence[GenerationRequest], Callable[[int, int, str], None] | None], list[GenerationResult]]


class QueueFull(Exception):
    """``max_waiting`` requests already wait for a batch."""


@dataclass(frozen=True)
class Ticket:
    """One request waiting for a batch: ``on_token(token id, text)`` as its tokens come (None: not streamed) and
    ``on_done(result or exception)`` once, both called from the batch thread."""

    request: GenerationRequest
    on_token: Callable[[int, str], None] | None
    on_done: Callable[[GenerationResult | BaseException], None]


@dataclass(frozen=True)
class BatchStats:
    """What the queue has served: ``batches`` run, ``requests`` answered, the ``largest`` batch, and the
    requests ``waiting`` now."""

    batches: int
    requests: int
    largest: int
    waiting: int


class BatchQueue:
    """The waiting tickets (thread-safe)."""

    def __init__(self, max_batch_size: int = 8, max_waiting: int = 64):
        if max_batch_size < 1 or max_waiting < 1:
            raise ValueError(f"max_batch_size and max_waiting must be >= 1, got {max_batch_size}, {max_waiting}")
        self.max_batch_size = max_batch_size
        self._waiting: queue.Queue[Ticket] = queue.Queue(max_waiting)
        self._lock = threading.Lock()
        self._served = (0, 0, 0)  # batches, requests, largest

    def put(self, ticket: Ticket) -> None:
        """Queue ``ticket`` for the next batch; raises ``QueueFull``."""
        try:
            self._waiting.put_nowait(ticket)
        except queue.Full:
            raise QueueFull(f"{self._waiting.maxsize} requests already wait for a batch; retry later") from None

    def take(self, timeout_s: float) -> list[Ticket]:
        """The next batch: the first ticket to come within ``timeout_s`` seconds (none: ``[]``), with every other
        one waiting then, up to ``max_batch_size``."""
        try:
            batch = [self._waiting.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while len(batch) < self.max_batch_size:
            try:
                batch.append(self._waiting.get_nowait())
            except queue.Empty:
                break
        return batch

    def record(self, size: int) -> None:
        """Count a batch of ``size`` requests served."""
        with self._lock:
            batches, requests, largest = self._served
            self._served = (batches + 1, requests + size, max(largest, size))

    def stats(self) -> BatchStats:
        with self._lock:
            return BatchStats(*self._served, waiting=self._waiting.qsize())


def run_batches(batches: BatchQueue, generate: GenerateFn, stop: threading.Event, poll_s: float = 0.1) -> None:
    """Serve ``batches`` with ``generate`` until ``stop`` is set (checked every ``poll_s`` seconds while idle).
    A batch that raises hands the exception to each of its tickets; the loop goes on."""
    while not stop.is_set():
        batch = batches.take(poll_s)
        if not batch:
            continue

        def on_token(index: int, token_id: int, text: str) -> None:
            sink = batch[index].on_token
            if sink is not None:
                sink(token_id, text)

        try:
            results = generate([t.request for t in batch], on_token)
            if len(results) != len(batch):
                raise RuntimeError(f"the generator answered {len(results)} of {len(batch)} requests")
        except Exception as e:  # noqa: BLE001 - each request of the batch gets it (a 400 or a 500)
            if not isinstance(e, UserError):  # a bug: its traceback goes to the log
                logging.getLogger(__name__).error("a batch of %d requests failed", len(batch), exc_info=e)
            for ticket in batch:
                ticket.on_done(e)
            continue
        batches.record(len(batch))
        for ticket, result in zip(batch, results):
            ticket.on_done(result)
