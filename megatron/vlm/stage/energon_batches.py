"""Micro-batches for one pipeline stage of one data-parallel rank from an Energon stream: the counterpart of
``megatron/vlm/batches.py``'s ``MicroBatches`` for ``--data-path`` an Energon dataset.

Each training step, this rank's ``M`` micro-batches are chosen at once (``Grouping.step_groups`` on the stream): in
order, ``--micro-batch-size`` samples each (``FixedGroups``), or one online ISF group each (``OnlineGroups``, with
``--omnibal-isf``).  Their pixels are then decoded by a small thread pool (a stage that reads no pixels decodes none),
ahead of the schedule asking for them; the family's ``Batcher`` collates them through the JSONL path's ``Collate``
(context-parallel split, the stage's ``MicroBatch``).  Only the TP rank 0 of a stage loads; it broadcasts to its TP
group, as the JSONL path does.

Position: a step's micro-batches are all consumed before a checkpoint (saves fall between iterations), so the
position is the stream's (loader state and buffered samples' restore keys) and the grouping's; ``sharded_state``
gives it as one ``ShardedObject`` per data-parallel rank (the pipeline, tensor and context-parallel ranks of a
data-parallel rank read the same stream: one copy saved), so a checkpoint resumes under another TP, PP or layout with
the same data-parallel size and worker count; ``state_dict`` (the common state's "data") says it is an Energon
stream's.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject

from omnibal_ext.data.online_isf import Exchange, OnlineISF
from omnibal_ext.errors import UserError

from megatron.vlm.data.energon.encoder import EncodedChat
from megatron.vlm.data.energon.look_ahead import balanced_step
from megatron.vlm.data.energon.stream import SampleStream, pack_state, unpack_state
from megatron.vlm.data.record_sample import ReaderConfig
from megatron.vlm.stage.batches import BatchRecords, Collate, StageInputs
from megatron.vlm.stage.micro_batch import MicroBatch, broadcast_micro_batch

STATE_KIND = "energon"
STATE_KEY = "energon_data_state"  # the checkpoint's per-data-parallel-rank object


class Grouping(Protocol):
    """How a rank's step is chosen: ``step_groups(stream)`` -> its ``microbatches`` groups of samples (each one
    micro-batch, ``packed`` into one row or padded rows), ``state_dict``/``load_state_dict`` its own position."""

    packed: bool

    def step_groups(self, stream: SampleStream) -> list[list[EncodedChat]]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclasses.dataclass
class FixedGroups:
    """``microbatches`` micro-batches of ``micro_batch_size`` samples each, in stream order (padded rows)."""

    micro_batch_size: int
    microbatches: int
    packed: bool = False

    def step_groups(self, stream: SampleStream) -> list[list[EncodedChat]]:
        return [[stream.next_sample() for _ in range(self.micro_batch_size)] for _ in range(self.microbatches)]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass




@dataclasses.dataclass
class OnlineGroups:
    """One online ISF group per micro-batch: ``isf`` packs this rank's groups out of its stream's look-ahead buffer
    of ``buffer_size`` samples (``look_ahead.balanced_step``), ``exchange`` all-gathering its summaries across the
    data-parallel ranks; a sample over a count cap is refused by its name, with ``oversize_hint`` after the reason.

    Epochs: when this rank's loader ends an epoch (``stream.exhausted``) the buffer drains (``final``), so the rank
    serves its whole share of an epoch before any sample of the next.  A step the drain cannot fill (the algorithm
    returns fewer groups than micro-batches) takes its remaining groups from the next epoch in stream order,
    ``samples_per_group`` samples each, unbalanced: at most one such step per epoch of a rank."""

    isf: OnlineISF
    exchange: Exchange
    buffer_size: int
    microbatches: int
    samples_per_group: int = 1
    oversize_hint: str = ""
    packed: bool = True

    def step_groups(self, stream: SampleStream) -> list[list[EncodedChat]]:
        stream.fill(self.buffer_size)
        out = balanced_step(self.isf, stream.buffer, self.exchange, stream.exhausted, lambda s: s.name,
                            self.oversize_hint)
        if len(out) > self.microbatches or any(not g for g in out) or (len(out) < self.microbatches
                                                                       and not stream.exhausted):
            raise RuntimeError(f"online ISF gave {len(out)} group(s) (sizes {[len(g) for g in out]}) for a step "
                               f"of {self.microbatches} micro-batches")
        while len(out) < self.microbatches:  # the epoch's end: the rest of the step from the next epoch, in order
            out.append([stream.next_sample() for _ in range(self.samples_per_group)])
        return out

    def state_dict(self) -> dict:
        return self.isf.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.isf.load_state_dict(state)


class EnergonBatches(BatchRecords):
    """Endless iterator of this stage's micro-batches from an Energon stream (see the module docstring).

    stream: this data-parallel rank's ``SampleStream`` (None on a TP rank that does not load: it receives the
    broadcast); grouping: ``FixedGroups`` or ``OnlineGroups``; config: the reader's settings (its rules decode the
    pixels); collate: the JSONL path's ``Collate`` (packed or padded as the grouping is); decode_threads: threads
    decoding pixels ahead; dp_rank, dp_size: this rank's place (the sharded state's key); main_copy: this rank saves
    the data-parallel rank's state (its first pipeline, tensor and context-parallel rank); make_stream: rebuilds a
    fresh stream (``reset``: evaluation restarts its pass); samples_per_pass: samples of one pass of this rank's share
    (None: endless)."""

    def __init__(self, stream: SampleStream | None, grouping: Grouping, config: ReaderConfig, collate: Collate,
                 microbatches: int, *, tp_group=None, tp_src: int = 0, decode_threads: int = 1, dp_rank: int = 0,
                 dp_size: int = 1, main_copy: bool = True, make_stream: Callable[[], SampleStream] | None = None,
                 samples_per_pass: int | None = None):
        self.stream, self.grouping, self.config, self.collate = stream, grouping, config, collate
        self.inputs: StageInputs = collate.inputs
        self.packed = grouping.packed
        self.microbatches = microbatches
        self.tp_group, self.tp_src = tp_group, tp_src
        self.dp_rank, self.dp_size, self.main_copy = dp_rank, dp_size, main_copy
        self.make_stream = make_stream
        self.samples_per_pass = samples_per_pass
        self.iteration = 0
        self.resumed: str | None = None
        self._pool = ThreadPoolExecutor(max(1, decode_threads)) if stream is not None else None
        self._step: list[tuple[Future, list[EncodedChat]]] = []

    # ------------------------------------------------------------------ serving
    def __iter__(self):
        return self

    def _start_step(self) -> None:
        groups = self.grouping.step_groups(self.stream)
        self._step = [(self._pool.submit(self._collate, group), group) for group in groups]

    def _collate(self, group: list[EncodedChat]) -> MicroBatch:
        pixels = self.inputs.pixels
        return self.collate([s.sample(self.config, pixels) for s in group])

    def __next__(self) -> MicroBatch:
        group = None
        if self.stream is not None:
            if not self._step:
                self._start_step()
            future, group = self._step.pop(0)
            try:
                batch = future.result()
            except UserError as e:  # a sample whose pixels are broken behind a readable header
                raise type(e)(f"{e} (decoding pixels; --skip-bad-samples checks every image and frame when it is read, "
                              "so that such a sample is left out)") from None
        else:
            batch = None
        times = None if group is None else {"vit_s": [s.cost.vit_s for s in group],
                                            "llm_s": [s.cost.llm_s for s in group]}
        if self.tp_group is not None:
            batch = broadcast_micro_batch(batch, self.tp_src, self.tp_group)
            if self.recording:  # the samples' predicted times, for the log's DistRatio in time
                box = [times]
                dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
                times = box[0]
        batch = dataclasses.replace(batch, iteration=self.iteration)  # the drop path's key
        self.record(batch, self.packed, **(times or {}))
        return batch

    def reset(self) -> None:
        """Back to the start of a pass (evaluation sees the same batches each time): a fresh stream."""
        self._step = []
        if self.stream is not None and self.make_stream is not None:
            self.stream.close()
            self.stream = self.make_stream()

    def close(self) -> None:
        """The run is done with these batches: the stream's loader workers and the decoding threads stop now."""
        if self.stream is not None:
            self.stream.close()
            self._pool.shutdown(cancel_futures=True)

    def iterations_per_pass(self) -> int:
        """Iterations of one pass over this rank's share (evaluation's default), at least 1."""
        per_iteration = self.microbatches * getattr(self.grouping, "micro_batch_size", 1)
        return max(1, (self.samples_per_pass or per_iteration) // per_iteration)

    # ------------------------------------------------------------------ position
    def _check_step_done(self) -> None:
        if self._step:
            raise RuntimeError(f"EnergonBatches: a position asked with {len(self._step)} micro-batch(es) of the step "
                               "unserved (checkpoints fall between iterations)")

    def state_dict(self) -> dict:
        """The common state's "data": that the position is an Energon stream's, per data-parallel rank."""
        return {"kind": STATE_KIND, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict) -> None:
        """Check the common state's "data" (the position itself comes with ``load_sharded_state``)."""
        if state.get("kind") != STATE_KIND:
            raise UserError("the checkpoint's data position is a meta JSON/JSONL dataset's (its sample order), this "
                            "run reads an Energon dataset: resume with the same --data-path, or start from scratch "
                            "(--load of the weights only: `omnibal hf export`, or a new --save folder)")

    def sharded_state(self, for_loading: bool = False) -> dict:
        """``{STATE_KEY: ShardedObject}``: this data-parallel rank's position (one object per data-parallel rank,
        saved by ``main_copy``); {} on a rank that does not load."""
        if self.stream is None:
            return {}
        data = None
        if not for_loading:
            self._check_step_done()
            blob = pack_state({"stream": self.stream.state_dict(), "grouping": self.grouping.state_dict()})
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return {STATE_KEY: ShardedObject(STATE_KEY, data, (self.dp_size,), (self.dp_rank,),
                                         replica_id=0 if self.main_copy else 1)}

    def load_sharded_state(self, loaded: dict) -> None:
        """Continue at the position ``sharded_state`` saved (``loaded``: the checkpoint's objects by key)."""
        if self.stream is None:
            return
        if STATE_KEY not in loaded:
            raise UserError("the checkpoint holds no Energon loader position for this data-parallel rank")
        state = unpack_state(bytes(loaded[STATE_KEY].numpy().tobytes()))
        self.stream.load_state_dict(state["stream"])
        self.grouping.load_state_dict(state["grouping"])
        self._step = []
        self.resumed = "continued"


__all__: Sequence[str] = ("EnergonBatches", "FixedGroups", "Grouping", "OnlineGroups", "STATE_KEY")
