"""Micro-batches for one pipeline stage of one data-parallel rank: groups of sample indices -> batches.

Random batching and ISF share this path: a *group* is the list of samples of one micro-batch
(K random samples, padded; or one ISF pack, concatenated), and omnibal_ext's GroupBatchSampler
hands each data-parallel rank its group of every step, resumably.

Loading.  A ``torch.utils.data.DataLoader`` does the work: its ``batch_sampler`` is the
GroupBatchSampler (the single source of order: it yields the group's sample indices), its
``collate_fn`` builds the micro-batch from those samples: the family's ``Batcher`` collates them into
fields, splits them for context parallelism, and types them as the stage's ``micro_batch.MicroBatch``.  ``num_workers`` worker processes read and
decode ahead (``prefetch_factor`` micro-batches each, ``persistent_workers``); 0 reads in the
training process.  Batches are the same, in the same order, for any ``num_workers``.

What a stage loads (``StageInputs``, from its units' runtime components): pixels where the ViT embedding
is, tokens (and the image-tile index) where the LLM embedding is, labels where the head is, packing
metadata where LLM layers or the head are; the sample part (``sample_tokens``/``sample_tiles``...) everywhere.
The parts and fields a stage does not read are None in its ``MicroBatch``.
A stage without the ViT embedding opens no image file.

Tensor parallelism.  The TP ranks of a stage need the same batch: only TP rank 0 loads it, and
broadcasts it over the TP group (``micro_batch.broadcast_micro_batch``); the other TP ranks have no loader.

Resuming.  The loader runs ahead of training (prefetch), so the sampler's own position is not the
training's.  ``MicroBatches`` counts the steps training consumed: ``state_dict()`` is the sampler's
state at that step, and ``load_state_dict``/``reset`` rebuild the loader's iterator from there.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from omnibal_ext.data.sampler import GroupBatchSampler
from omnibal_ext.errors import UserError

from megatron.vlm.data.collate import check_image_tokens
from megatron.vlm.data.loader_workers import stop_workers
from megatron.vlm.stage.data_side import Batcher
from megatron.vlm.stage.micro_batch import StageInputs  # noqa: F401  (callers take it from here)
from megatron.vlm.stage.micro_batch import MicroBatch, broadcast_micro_batch


class StageDataset(torch.utils.data.Dataset):
    """The dataset as a stage reads it: images decoded only when the stage needs pixels."""

    def __init__(self, dataset, images: bool):
        self.dataset, self.images = dataset, images

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        if hasattr(self.dataset, "sample"):
            sample = self.dataset.sample(index, decode_images=self.images)
        else:
            sample = self.dataset[index]
            sample = sample if self.images else {k: v for k, v in sample.items() if k != "pixel_values"}
        return {**sample, "sample_id": index}  # the drop path's key (megatron/vlm/layers/drop_path.py)


class Collate:
    """collate_fn of the loader: samples -> the stage's ``MicroBatch`` (picklable)."""

    def __init__(self, pad_id: int, packed: bool, inputs: StageInputs, image_tokens: tuple[int, int] | None,
                 pad_to_multiple: int = 1, cp: int = 1, cp_rank: int = 0, batcher: Batcher | None = None):
        """pad_to_multiple: --sequence-parallel's TP: without CP the row length is rounded up to a multiple of it,
        with CP every segment to a multiple of 2 x CP x it (``Batcher.split_cp``).  batcher: the family's micro-batch
        maker (``megatron.vlm.stage.data_side``; default: ``collate.py``'s fields)."""
        self.pad_id, self.packed, self.inputs, self.image_tokens = pad_id, packed, inputs, image_tokens
        self.pad_to_multiple = pad_to_multiple
        self.cp, self.cp_rank = cp, cp_rank  # context parallelism: this rank's part (megatron/vlm/parallel/context_parallel.py)
        self.batcher = batcher or Batcher()

    def __call__(self, samples: list[dict]) -> MicroBatch:
        row_multiple = self.pad_to_multiple if self.cp == 1 else 1
        batch = self.batcher.make(samples, self.pad_id, self.packed, row_multiple)
        if self.image_tokens is not None and self.inputs.tokens:
            check_image_tokens(batch, *self.image_tokens)
        if self.cp > 1:
            img_context_id = self.image_tokens[0] if self.image_tokens else None
            batch = self.batcher.split_cp(batch, self.cp, self.cp_rank, self.pad_id, img_context_id,
                                          sp_tp=self.pad_to_multiple)
        return self.batcher.micro_batch(batch, self.inputs)


class _Steps:
    """The loader's batch_sampler: the sampler's groups from its current step (a new pass per iterator)."""

    def __init__(self, sampler: GroupBatchSampler):
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def worker_message(error: BaseException) -> str:
    """The message of ``error`` as raised: torch's DataLoader re-raises a worker's exception with "Caught ... in
    DataLoader worker process N" and the worker's traceback before it."""
    text = str(error)
    marker = f"{type(error).__name__}: "
    if not text.startswith("Caught ") or marker not in text:
        return text
    return text[text.rfind(marker) + len(marker):].strip()


class BatchRecords:
    """What the step metrics read of the micro-batches served between ``start_recording`` and ``stop_recording``:
    per micro-batch its samples' tokens, ViT items and ids, whether it is packed, and the caller's extra fields."""

    _records: list | None = None

    def start_recording(self) -> None:
        self._records = []

    def stop_recording(self) -> list[dict]:
        records, self._records = self._records or [], None
        return records

    @property
    def recording(self) -> bool:
        return self._records is not None

    def close(self) -> None:
        """The run is done with these batches: stop what loads them (worker processes) now."""

    def record(self, batch: MicroBatch, packed: bool, **extra) -> None:
        if self._records is not None:
            info = batch.samples
            self._records.append({"tokens": info.sample_tokens.tolist(), "tiles": info.sample_tiles.tolist(),
                                  "ids": info.sample_ids.tolist(), "packed": packed, **extra})


class MicroBatches(BatchRecords):
    """Endless iterator of collated micro-batches; records the sample sizes it served.

    inputs: what this stage reads (default: everything).  num_workers, prefetch_factor,
    pin_memory, persistent_workers: the DataLoader's.  tp_group, tp_src: the TP group of the stage and
    the global rank of its TP rank 0 (which alone loads and broadcasts); None: every rank loads.  cp, cp_rank:
    context parallelism (each CP rank keeps its part of every micro-batch: ``Batcher.split_cp``).  batcher: the
    family's micro-batch maker (``FamilyRuntime.data``; default: ``collate.py``'s fields).
    """

    def __init__(self, dataset, sampler: GroupBatchSampler, pad_id: int, packed: bool,
                 image_tokens: tuple[int, int] | None = None, inputs: StageInputs | None = None,
                 num_workers: int = 0, prefetch_factor: int = 2, pin_memory: bool = False,
                 persistent_workers: bool = True, tp_group=None, tp_src: int = 0, pad_to_multiple: int = 1,
                 cp: int = 1, cp_rank: int = 0, batcher: Batcher | None = None):
        """image_tokens: (image-context token id, tokens per tile): check each micro-batch's image-token
        count against its real tiles on the host (the model's forward does not)."""
        if num_workers < 0:
            raise ValueError(f"MicroBatches: num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.image_tokens = image_tokens
        self.sampler = sampler
        self.packed = packed
        self.inputs = inputs or StageInputs.everything()
        self.num_workers = num_workers
        self.tp_group, self.tp_src = tp_group, tp_src
        self.collate = Collate(pad_id, packed, self.inputs, image_tokens, pad_to_multiple, cp, cp_rank, batcher)
        self.iteration = 0  # the training iteration the served micro-batches belong to (set by the trainer)
        self._loads = tp_group is None or dist.get_rank() == tp_src
        self.loader = None
        if self._loads:
            kw = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers) if num_workers else {}
            self.loader = torch.utils.data.DataLoader(
                StageDataset(dataset, images=self.inputs.pixels), batch_sampler=_Steps(sampler),
                collate_fn=self.collate, num_workers=num_workers, pin_memory=pin_memory, **kw)
        self._restart()

    def _restart(self) -> None:
        """Serve from the sampler's current step: a fresh loader iterator (prefetched batches dropped)."""
        self._consumed = self.sampler.step
        self._it = iter(self.loader) if self._loads else None

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        if self.sampler.num_steps is not None and self._consumed >= self.sampler.num_steps:
            raise StopIteration
        batch = self._next_loaded() if self._loads else None
        if self.tp_group is not None:
            batch = broadcast_micro_batch(batch, self.tp_src, self.tp_group)
        self._consumed += 1
        batch = dataclasses.replace(batch, iteration=self.iteration)  # the drop path's key (megatron/vlm/layers/drop_path.py)
        self.record(batch, self.packed)
        return batch

    def _next_loaded(self) -> MicroBatch:
        try:
            return next(self._it)
        except UserError as e:  # from a worker, the DataLoader re-raises it with the worker's traceback in its text
            raise type(e)(worker_message(e)) from None

    def reset(self) -> None:
        """Back to the first step (evaluation sees the same batches each time)."""
        self.sampler.seek(0)
        self._restart()

    def close(self) -> None:
        self._it = None
        stop_workers(self.loader)

    def state_dict(self) -> dict:
        """The sampler's state at the step training has consumed (not where the loader prefetched to)."""
        ahead = self.sampler.step
        self.sampler.step = self._consumed
        try:
            return self.sampler.state_dict()
        finally:
            self.sampler.step = ahead

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") == "energon":
            raise UserError("the checkpoint's data position is an Energon stream's (per data-parallel rank), this run "
                            "reads a meta JSON/JSONL dataset: resume with the same --data-path, or start from scratch")
        self.sampler.load_state_dict(state)
        self._restart()

    @property
    def resumed(self) -> str | None:
        """How ``load_state_dict`` continued (the sampler's ``resumed``)."""
        return self.sampler.resumed

    def iterations_per_pass(self) -> int:
        """Iterations of one pass over the groups (evaluation's default), at least 1."""
        return max(1, self.sampler.num_groups // self.sampler.block)
