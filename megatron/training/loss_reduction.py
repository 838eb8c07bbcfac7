"""How answer-token losses are reduced to a global batch's loss (``--loss-reduction``), as VLM fine-tuning defines
them:

* ``token``: every answer token weighs the same (w(n) = 1);
* ``sample``: every sample weighs the same (w(n) = 1/n: each sample's mean);
* ``square``: a sample with n answer tokens weighs each of them 1/sqrt(n).

The loss of a global batch is ``sum_s w(n_s) sum_{i in s} l_i / sum_s w(n_s) n_s`` over all its samples s
(n_s answer tokens), so loss and gradients depend neither on DP, micro-batch size, packing nor PP (a
normaliser per micro-batch would).  The normaliser ``D = sum_s w(n_s) n_s`` of the whole global batch is
known before the step: the loss stage pulls the iteration's micro-batches first (``prefetch``; the counts n_s
are host metadata of the collate, ``sample_answers``) and all-reduces its share of D over DP (a host tensor,
gloo).  The configs set megatron-core's ``calculate_per_token_loss``: the schedule sums the micro-batches'
losses, DDP sums over the data-parallel ranks and ``finalize_model_grads`` divides by the loss functions'
counts summed over both.  ``token`` keeps megatron's per-token loss (loss sum, answer tokens: D is the global
token count, no prefetch needed); ``sample``/``square`` return (weighted sum x ``M * dp / D``, 1), so the
division by M * dp leaves sum / D.  Nothing in the step waits for a device value.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.vlm.stage.micro_batch import MicroBatch

REDUCTIONS = ("token", "sample", "square")


def weight(n: int, reduction: str) -> float:
    """w(n) of a sample with ``n`` answer tokens (0 when it has none: it adds nothing)."""
    if n <= 0:
        return 0.0
    if reduction == "token":
        return 1.0
    if reduction == "sample":
        return 1.0 / n
    if reduction == "square":
        return 1.0 / math.sqrt(n)
    raise ValueError(f"loss reduction must be one of {REDUCTIONS}, got {reduction!r}")


def normaliser(answer_counts, reduction: str) -> float:
    """sum_s w(n_s) n_s over samples with ``answer_counts`` n_s."""
    return float(sum(weight(int(n), reduction) * int(n) for n in answer_counts))


def reduce_loss(per_sample_sums, answer_counts, reduction: str):
    """The closed form: (sum_s w(n_s) * per_sample_sums[s]) / normaliser, for the tests and scripts."""
    num = sum(weight(int(n), reduction) * float(v) for v, n in zip(per_sample_sums, answer_counts))
    return num / max(normaliser(answer_counts, reduction), 1e-30)


def prefetch(data_iterator, num_microbatches: int, reduction: str, group) -> tuple[list[MicroBatch], float]:
    """(the iteration's micro-batches, D over the whole global batch): pulls ``num_microbatches`` micro-batches
    from ``data_iterator`` and sums their normalisers over ``group`` (the data-parallel gloo group)."""
    batches = [next(data_iterator) for _ in range(num_microbatches)]
    local = torch.tensor([sum(normaliser(b.samples.sample_answers, reduction) for b in batches)], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
    return batches, float(local[0])
