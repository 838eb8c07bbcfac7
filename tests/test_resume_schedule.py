"""A resumed run's LR schedule, as in Megatron-LM: a schedule that differs from the checkpoint's is refused before any
tensor is read, naming both values and the two flags; --override-opt_param-scheduler follows the flags (the
scheduler's and each parameter group's peak, which the optimizer's state carries), --use-checkpoint-opt_param-scheduler
keeps the checkpoint's; --lr-decay-iters keeps a schedule over a longer run. The LR is checked against the closed form
of the schedule at the checkpoint's step. And the NaN check's flags, on real tensors."""
import math
import re

import pytest
import torch

import trainer_parts
from trainer_parts import NoData

pytestmark = pytest.mark.usefixtures("megatron_world")

GBS = 16
BASE = ["--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--micro-batch-size", "4",
        "--global-batch-size", str(GBS)]


def cosine_lr(iteration: int, peak: float, low: float, warmup: int, decay: int) -> float:
    """The LR applied by iteration ``iteration + 1`` (after ``iteration`` steps) of a warm-up from 0 then a cosine
    decay from ``peak`` to ``low`` over ``decay`` iterations."""
    if iteration <= warmup:
        return peak * iteration / warmup
    ratio = (iteration - warmup) / (decay - warmup)
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * ratio))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of iteration 3 of a 10-iteration run at --lr 2e-3, --vision-lr 4e-3."""
    from megatron.training.checkpointing import save_checkpoint

    folder = tmp_path_factory.mktemp("schedule") / "ckpt"
    plan, model, optimizer, scheduler = trainer_parts.build(
        BASE + ["--lr", "2e-3", "--vision-lr", "4e-3", "--train-iters", "10", "--save", str(folder)])
    for _ in range(3):
        for p in model[0].parameters():
            p.main_grad.fill_(1e-3)
        assert optimizer.step()[0]
        scheduler.step(increment=GBS)
    save_checkpoint(plan, 3, 3 * GBS, model, optimizer, scheduler, NoData())
    return folder


def resume(saved, flags):
    from megatron.training.checkpointing import find_checkpoint, load_checkpoint

    plan, model, optimizer, scheduler = trainer_parts.build(BASE + flags + ["--load", str(saved)])
    load_checkpoint(find_checkpoint(str(saved)), plan, model, optimizer, scheduler)
    return optimizer, scheduler


def lrs(optimizer) -> dict:
    """{peak LR of a group: the LR its next step applies} (the --lr groups and the --vision-lr group)."""
    return {g["max_lr"]: g["lr"] for g in optimizer.param_groups}


def test_a_new_lr_is_refused_before_any_tensor_is_read(saved, monkeypatch):
    from megatron.core import dist_checkpointing

    from megatron.training.checkpointing import CheckpointError

    def no_load(*a, **k):
        raise AssertionError("tensors read before the schedule was checked")

    monkeypatch.setattr(dist_checkpointing, "load", no_load)
    with pytest.raises(CheckpointError) as e:
        resume(saved, ["--lr", "1e-3", "--vision-lr", "4e-3", "--train-iters", "10"])
    assert str(e.value) == (
        f"--load {saved} (iteration 3): the checkpoint's LR schedule or Adam settings differ from this run's flags: "
        "learning rate 0.002 saved, 0.001 now (--lr). Give --override-opt_param-scheduler to follow this run's flags, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule (either continues from the "
        "checkpoint's step)")
    with pytest.raises(CheckpointError, match="decay samples 160 saved, 320 now"):  # a longer run
        resume(saved, ["--lr", "2e-3", "--vision-lr", "4e-3", "--train-iters", "20"])


def test_a_new_vision_lr_or_adam_beta_is_refused_too(saved):
    """What the optimizer's parameter groups carry of the flags (the checkpoint's would win unnoticed)."""
    from megatron.training.checkpointing import CheckpointError

    with pytest.raises(CheckpointError, match="peak/minimum LR of a parameter group of its own 0.004/0.0002 saved, "
                                              "0.001/5e-05 now"):
        resume(saved, ["--lr", "2e-3", "--vision-lr", "1e-3", "--train-iters", "10"])
    with pytest.raises(CheckpointError, match=re.escape("Adam betas (0.9, 0.95) saved, (0.9, 0.99) now "
                                                        "(--adam-beta1, --adam-beta2)")):
        resume(saved, ["--lr", "2e-3", "--vision-lr", "4e-3", "--train-iters", "10", "--adam-beta2", "0.99"])
    optimizer, _ = resume(saved, ["--lr", "2e-3", "--vision-lr", "4e-3", "--train-iters", "10", "--adam-beta2", "0.99",
                                  "--override-opt_param-scheduler"])
    assert {tuple(g["betas"]) for g in optimizer.param_groups} == {(0.9, 0.99)}


def test_override_follows_the_flags_from_the_checkpoints_step(saved, capsys):
    optimizer, scheduler = resume(saved, ["--lr", "1e-3", "--vision-lr", "3e-3", "--train-iters", "20",
                                          "--override-opt_param-scheduler"])
    assert scheduler.num_steps == 3 * GBS
    assert lrs(optimizer) == pytest.approx({1e-3: cosine_lr(3, 1e-3, 1e-4, 2, 20),
                                            3e-3: cosine_lr(3, 3e-3, 3e-4, 2, 20)}, rel=1e-12)
    out = capsys.readouterr().out
    assert "> --override-opt_param-scheduler: the LR schedule and Adam settings follow this run's flags: learning " \
           "rate 0.002 saved, 0.001 now (--lr)" in out


def test_use_checkpoint_keeps_the_checkpoints_schedule(saved, capsys):
    optimizer, scheduler = resume(saved, ["--lr", "1e-3", "--vision-lr", "3e-3", "--train-iters", "20",
                                          "--use-checkpoint-opt_param-scheduler"])
    assert lrs(optimizer) == pytest.approx({2e-3: cosine_lr(3, 2e-3, 1e-4, 2, 10),
                                            4e-3: cosine_lr(3, 4e-3, 2e-4, 2, 10)}, rel=1e-12)
    assert "the checkpoint's LR schedule and Adam settings are kept over the flags" in capsys.readouterr().out


def test_lr_decay_iters_keeps_the_schedule_of_a_longer_run(saved):
    optimizer, scheduler = resume(saved, ["--lr", "2e-3", "--vision-lr", "4e-3", "--train-iters", "20",
                                          "--lr-decay-iters", "10"])
    assert lrs(optimizer) == pytest.approx({2e-3: cosine_lr(3, 2e-3, 1e-4, 2, 10),
                                            4e-3: cosine_lr(3, 4e-3, 2e-4, 2, 10)}, rel=1e-12)
    scheduler.step(increment=10 * GBS)  # past the decay: the minimum
    assert lrs(optimizer) == pytest.approx({2e-3: 1e-4, 4e-3: 2e-4}, rel=1e-12)


def test_the_logged_lr_is_the_one_the_step_applies():
    """Iteration 1 of a warm-up from 0 applies LR 0 (megatron-core's init_lr), iteration 2 a half of the peak."""
    from megatron.training.training import applied_lr

    _, _, optimizer, scheduler = trainer_parts.build(BASE + ["--lr", "2e-3", "--train-iters", "10"])
    assert applied_lr(optimizer) == 0.0
    scheduler.step(increment=GBS)
    assert applied_lr(optimizer) == pytest.approx(cosine_lr(1, 2e-3, 1e-4, 2, 10), rel=1e-12) == 1e-3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_flags(bad):
    from megatron.training.finite_check import local_flags

    report = {"lm loss": torch.tensor([3.0, 16.0])}
    grads = [torch.zeros(10), torch.ones(7)]
    assert local_flags([report, report], grads) == (False, False)
    assert local_flags([], []) == (False, False)  # a stage without the loss and without trained parameters
    assert local_flags([report, {"lm loss": torch.tensor([bad, 16.0])}], grads) == (True, False)
    grads[1][3] = bad
    assert local_flags([report], grads) == (False, True)


def test_other_parameter_groups_are_refused_in_one_line(saved):
    """A run without --vision-lr has no group of its own for the ViT: the checkpoint's groups do not fit."""
    from megatron.training.checkpointing import CheckpointError

    with pytest.raises(CheckpointError, match="the checkpoint's optimizer holds other parameter groups than this "
                                              "run's .*--vision-lr and --projector-lr make groups of their own"):
        resume(saved, ["--lr", "2e-3", "--train-iters", "10"])
