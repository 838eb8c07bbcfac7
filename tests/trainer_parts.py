"""The trainer's parts built in-process from flags (model, optimizer, LR scheduler), for tests that step, save and
load without data: inside ``megatron_world`` (a world of one) or a worker's process group."""
import dataclasses

import torch


class NoData:
    """The training data's place in a checkpoint, for saves without a loader."""

    def state_dict(self):
        return {}


def build(argv: list[str], world_size: int = 1):
    """(args, plan, model, optimizer, scheduler) of a CPU run with flags ``argv`` (layout and recompute from them)."""
    from megatron.training import setup, training
    from megatron.training.arguments import parse_args
    from megatron.training.run_plan import plan_run

    args = parse_args(argv, world_size)
    plan = plan_run(args, world_size, torch.device("cpu"))
    plan = dataclasses.replace(plan, layout=setup.choose_layout(args, plan))
    plan = dataclasses.replace(plan, recompute=setup.recompute_settings(args, plan))
    model = training.build_model(args, plan, 5, torch.device("cpu"))
    optimizer, scheduler = training.build_optimizer(args, plan, model)
    return args, plan, model, optimizer, scheduler
