"""Micro-batches for one data-parallel rank: groups of sample indices -> collated batches.

Random batching and ISF share this path: a *group* is the list of samples of one micro-batch
(K random samples, padded; or one ISF pack, concatenated), and omnibal_ext's GroupBatchSampler
hands each data-parallel rank its group of every step, resumably.
"""
from __future__ import annotations

from functools import partial

from omnibal_ext.data.sampler import GroupBatchSampler

from megatron.vlm.data.collate import check_image_tokens, collate_packed, collate_padded


class MicroBatches:
    """Endless iterator of collated micro-batches; records the sample sizes it served."""

    def __init__(self, dataset, sampler: GroupBatchSampler, pad_id: int, packed: bool, seq_length: int | None = None,
                 image_tokens: tuple[int, int] | None = None):
        """image_tokens: (image-context token id, tokens per tile): check each micro-batch's image-token
        count against its real tiles on the host (the model's forward does not)."""
        self.dataset = dataset
        self.image_tokens = image_tokens
        self.sampler = sampler
        self.packed = packed
        self.collate = partial(collate_packed, pad_id=pad_id) if packed else partial(
            collate_padded, pad_id=pad_id, seq_length=None)
        self._records = None
        self._it = iter(sampler)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        indices = next(self._it)
        batch = self.collate([self.dataset[i] for i in indices])
        if self.image_tokens is not None:
            check_image_tokens(batch, *self.image_tokens)
        if self._records is not None:
            self._records.append({"tokens": batch["sample_tokens"].tolist(), "tiles": batch["sample_tiles"].tolist(),
                                  "packed": self.packed})
        return batch

    def start_recording(self) -> None:
        self._records = []

    def stop_recording(self) -> list[dict]:
        records, self._records = self._records or [], None
        return records

    def reset(self) -> None:
        """Back to the first step (evaluation sees the same batches each time)."""
        self.sampler.seek(0)
        self._it = iter(self.sampler)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it = iter(self.sampler)
