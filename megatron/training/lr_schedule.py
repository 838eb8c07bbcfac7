"""The learning-rate and weight-decay schedule: megatron-core's ``OptimizerParamScheduler`` built from the flags,
and what a resume does with a checkpoint's schedule (Megatron-LM's rules).

A resumed run follows one of three rules (``ResumeRule``), as in Megatron-LM:

* ``CHECK`` (no flag): the checkpoint's schedule and this run's flags must agree; a difference is refused,
  naming both values and the two flags below, before any tensor is loaded;
* ``OVERRIDE`` (``--override-opt_param-scheduler``): this run's flags replace the checkpoint's values;
* ``CHECKPOINT`` (``--use-checkpoint-opt_param-scheduler``): the checkpoint's values are kept, whatever the flags say.

In every rule the schedule continues from the checkpoint's step. The schedule is the scheduler's state (peak and
minimum LR, warm-up and decay steps, decay style, weight decay) and what the optimizer's parameter groups carry of the
flags: each group's own peak and minimum (``--vision-lr``, ``--projector-lr``) and Adam's betas.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

OVERRIDE_FLAG = "--override-opt_param-scheduler"
CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


class ResumeRule(enum.Enum):
    CHECK = "check"
    OVERRIDE = "override"
    CHECKPOINT = "checkpoint"

    @classmethod
    def of(cls, override: bool, use_checkpoint: bool) -> "ResumeRule":
        """The rule of the two flags (which the argument checks never let come together)."""
        return cls.OVERRIDE if override else cls.CHECKPOINT if use_checkpoint else cls.CHECK


@dataclass(frozen=True)
class Schedule:
    """A run's schedule in megatron-core's units: steps are samples (iterations x global batch size).

    The warm-up is capped below the decay (megatron-core needs fewer warm-up than decay steps): a run shorter than
    --lr-warmup-iters warms up over all but its last iteration, as before."""

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str
    weight_decay: float

    @classmethod
    def from_flags(cls, lr: float, min_lr: float, warmup_iters: int, decay_iters: int, decay_style: str,
                   weight_decay: float, global_batch: int) -> "Schedule":
        """``decay_iters``: --lr-decay-iters, else --train-iters (at least 1)."""
        decay_iters = max(decay_iters, 1)
        return cls(lr, min_lr, min(warmup_iters, decay_iters - 1) * global_batch, decay_iters * global_batch,
                   decay_style, weight_decay)

    def scheduler(self, optimizer, rule: ResumeRule) -> OptimizerParamScheduler:
        """megatron-core's scheduler; warm-up from LR 0; the weight decay constant (its "steps" are the decay's)."""
        return OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=self.max_lr, min_lr=self.min_lr, lr_warmup_steps=self.warmup_steps,
            lr_decay_steps=self.decay_steps, lr_decay_style=self.decay_style, start_wd=self.weight_decay,
            end_wd=self.weight_decay, wd_incr_steps=self.decay_steps, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=rule is ResumeRule.CHECKPOINT,
            override_opt_param_scheduler=rule is ResumeRule.OVERRIDE)


# the scheduler's state entries a schedule is made of: (what they are, the flag that sets them); the weight decay's
# increment steps and style follow from the decay and are not listed
_FIELDS = {
    "max_lr": ("learning rate", "--lr"),
    "min_lr": ("minimum learning rate", "--min-lr"),
    "lr_warmup_steps": ("warm-up samples", "--lr-warmup-iters x global batch size"),
    "lr_decay_steps": ("decay samples", "--lr-decay-iters (default --train-iters) x global batch size"),
    "lr_decay_style": ("decay style", "--lr-decay-style"),
    "start_wd": ("weight decay", "--weight-decay"),
}


def rule_of(scheduler: OptimizerParamScheduler) -> ResumeRule:
    return ResumeRule.of(scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler)


def schedule_differences(saved: dict, scheduler: OptimizerParamScheduler) -> list[str]:
    """``what SAVED saved, NOW now (FLAG)`` for each schedule entry where the checkpoint's scheduler state
    ``saved`` and this run's ``scheduler`` differ."""
    now = scheduler.state_dict()
    return [f"{what} {saved[key]!r} saved, {now[key]!r} now ({flag})" for key, (what, flag) in _FIELDS.items()
            if key in saved and saved[key] != now[key]]


GROUP_FIELDS = ("max_lr", "min_lr", "betas")  # what a parameter group carries of the flags, in a checkpoint too


def group_settings(optimizer) -> list[dict]:
    """Each of the optimizer's parameter groups' peak and minimum LR and Adam betas, in its order."""
    return [{key: group[key] for key in GROUP_FIELDS if key in group} for group in optimizer.param_groups]


def group_differences(run: list[dict], optimizer) -> list[str]:
    """Where the groups the optimizer holds now (after loading a checkpoint's state) differ from ``run`` (this run's,
    :func:`group_settings` before the load): Adam's betas, and the peak and minimum LR of the groups of their own
    (--vision-lr, --projector-lr; megatron-core's ``default_config`` groups follow --lr and --min-lr, which the
    scheduler's entries cover)."""
    out = set()
    for mine, group in zip(run, optimizer.param_groups):
        if "betas" in mine and tuple(group["betas"]) != tuple(mine["betas"]):
            out.add(f"Adam betas {tuple(group['betas'])!r} saved, {tuple(mine['betas'])!r} now (--adam-beta1, "
                    "--adam-beta2)")
        lrs = (group["max_lr"], group["min_lr"]), (mine["max_lr"], mine["min_lr"])
        if lrs[0] != lrs[1] and not group.get("default_config", False):
            out.add(f"peak/minimum LR of a parameter group of its own {lrs[0][0]!r}/{lrs[0][1]!r} saved, "
                    f"{lrs[1][0]!r}/{lrs[1][1]!r} now (--vision-lr, --projector-lr)")
    return sorted(out)


def refusal(where: str, differences: list[str]) -> str:
    return (f"{where}: the checkpoint's LR schedule or Adam settings differ from this run's flags: "
            f"{'; '.join(differences)}. Give "
            f"{OVERRIDE_FLAG} to follow this run's flags, or {CHECKPOINT_FLAG} to keep the checkpoint's schedule "
            "(either continues from the checkpoint's step)")


def note(rule: ResumeRule, differences: list[str]) -> str | None:
    """The log line of a resume whose schedule differs from the flags under ``rule`` (OVERRIDE or CHECKPOINT)."""
    if not differences:
        return None
    if rule is ResumeRule.OVERRIDE:
        return f"> {OVERRIDE_FLAG}: the LR schedule and Adam settings follow this run's flags: {'; '.join(differences)}"
    return (f"> {CHECKPOINT_FLAG}: the checkpoint's LR schedule and Adam settings are kept over the flags: "
            f"{'; '.join(differences)}")


def restore_group_settings(optimizer, run: list[dict]) -> None:
    """Put this run's per-group settings (:func:`group_settings`) back after loading a checkpoint's optimizer state
    (which carries the saved ones)."""
    for group, mine in zip(optimizer.param_groups, run):
        group.update(mine)
