"""Stop a run at the first NaN or Inf in the loss or the gradients, on every rank, before the optimizer step
(Megatron-LM's check, on by default; ``--no-check-for-nan-in-loss-and-grad`` turns it off).

megatron-core computes the gradient norm inside ``optimizer.step()``, which then updates at once, so the check
comes before it: each rank sums its loss reports (last pipeline stage) and each of its DDP gradient buffers (the
gradients after their data-parallel reduction, every stage's own parameters), one pass over the gradients and one
scalar per buffer; a non-finite sum means a non-finite value (the gradient norm megatron-core would compute is
then non-finite too). The two flags are all-reduced over the world, so every rank stops at the same iteration
with the same line, and nothing of that iteration reaches the weights or a checkpoint.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from omnibal_ext.errors import RunStopped


class NonFiniteError(RunStopped):
    """The loss or a gradient of an iteration is NaN or Inf; the message names the iteration."""


def _finite(values: list[torch.Tensor]) -> bool:
    """Whether the sum of ``values`` (tensors on one device) is finite: False when any element is NaN or Inf."""
    if not values:
        return True
    return bool(torch.isfinite(torch.stack([v.detach().float().sum() for v in values]).sum()))


def local_flags(loss_reports: list[dict], grad_buffers: list[torch.Tensor]) -> tuple[bool, bool]:
    """(this rank's loss is non-finite, its gradients are): ``loss_reports`` the loss function's report of each
    micro-batch (the last stage's; empty elsewhere), ``grad_buffers`` its DDP gradient buffers."""
    return (not _finite([r["lm loss"] for r in loss_reports]), not _finite(grad_buffers))


def grad_buffers(model) -> list[torch.Tensor]:
    """The gradient buffers (``grad_data``) of megatron-core's DistributedDataParallel model chunks ``model``."""
    return [buffer.grad_data for chunk in model for buffer in chunk.buffers + chunk.expert_parallel_buffers]


def stop_if_nonfinite(iteration: int, loss_bad: bool, grad_bad: bool, group=None) -> None:
    """All-reduce this rank's two flags over ``group`` (a gloo group of every rank; None: the default group, when
    it is gloo) and raise ``NonFiniteError`` on every rank when any rank saw a non-finite value."""
    flags = torch.tensor([int(loss_bad), int(grad_bad)], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if flags.any():
        what = " and ".join(name for name, bad in (("the loss", flags[0]), ("the gradients", flags[1])) if bad)
        raise NonFiniteError(
            f"iteration {iteration}: NaN or Inf in {what}: the run stops before this iteration's optimizer step "
            "(the weights and the checkpoints saved so far are those of the iterations before; nothing is saved "
            "now). A learning rate too high for the model (--lr) is the usual cause; "
            "--no-check-for-nan-in-loss-and-grad turns this check off")
