"""The trainer's parts built in-process from flags (model, optimizer, LR scheduler), for tests that step, save and
load without data: inside ``megatron_world`` (a world of one) or a worker's process group."""
import torch


class NoData:
    """The training data's place in a checkpoint, for saves without a loader."""

    def state_dict(self):
        return {}


def build(argv: list[str], world_size: int = 1):
    """(plan, model, optimizer, scheduler) of a CPU run with flags ``argv`` (layout and recompute from them)."""
    from megatron.training import setup, training
    from megatron.training.arguments import parse_config

    config = parse_config(argv, world_size)
    plan = setup.build_run_plan(config, config.model.spec, torch.device("cpu"))
    model = training.build_model(plan, 5, torch.device("cpu"))
    optimizer, scheduler = training.build_optimizer(plan, model)
    return plan, model, optimizer, scheduler
