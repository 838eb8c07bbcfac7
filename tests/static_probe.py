"""Build this rank's bf16 (or fp32) model and megatron-core optimizer on CPU, print measured static bytes
(megatron.training.memory.static_bytes) beside the memory model's prediction: before any step (Adam's moments
not allocated yet: static_bytes counts them as they will be) and after one optimizer step on zero gradients
(the moments torch allocated, measured).

    python tests/static_probe.py OUT_DIR [trainer flags]            # a world of one
    torchrun --nproc-per-node 2 tests/static_probe.py OUT_DIR ...   # DP 2

Writes OUT_DIR/rank<R>.json per rank: {"rank", "measured": {...breakdown after the step}, "before_step": {...},
"moment_tensors", "predicted", "params", "trained_params"} (a file each: two ranks printing to one stdout can
interleave their lines).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def moment_tensors(optimizer) -> dict:
    """Adam's state tensors as torch holds them after a step: {"exp_avg", "exp_avg_sq"} -> [count, bytes]."""
    from megatron.core.optimizer import ChainedOptimizer

    leaves = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    out = {"exp_avg": [0, 0], "exp_avg_sq": [0, 0]}
    for opt in leaves:
        for state in opt.optimizer.state.values():
            for key in out:
                if key in state:
                    out[key][0] += 1
                    out[key][1] += state[key].numel() * state[key].element_size()
    return out


def main(argv: list[str]) -> int:
    """``argv``: the folder each rank writes its ``rank<R>.json`` to, then the trainer's flags."""
    out_dir, argv = Path(argv[0]), argv[1:]
    from megatron.core import parallel_state
    from megatron.training import cpu_compat, setup, training
    from megatron.training.arguments import parse_config
    from megatron.training.initialize import destroy, initialize_distributed, set_seeds, world_size_from_env
    from megatron.training.memory import static_bytes
    from omnibal_ext.memory import memory_model
    from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs, unit_param_counts

    with cpu_compat.patched():
        config = parse_config(["--device", "cpu", *argv], world_size_from_env())
        parallel = config.parallel
        device = torch.device("cpu")
        initialize_distributed(device, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size)
        set_seeds(config.optim.seed)
        plan = setup.build_run_plan(config, config.model.spec, device)
        model = training.build_model(plan, 5, device)
        optimizer, _ = training.build_optimizer(plan, model)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        counts = unit_param_counts(plan.model_spec, parallel.tensor_model_parallel_size)
        params = sum(counts[i] for i in plan.layout.stage_range(stage))
        # the memory model's static bytes of this stage, frozen units (config.model.trainable) holding weights only
        costs = analytic_costs(plan.model_spec, MicroBatchShape(1, 64), tp=parallel.tensor_model_parallel_size)
        costs = config.model.trainable.apply(costs)
        predicted = memory_model.stage_memory(
            costs, plan.layout, None, parallel.pipeline_model_parallel_size, parallel.tensor_model_parallel_size,
            parallel.data_parallel_size, 1, parallel.use_distributed_optimizer,
            setup.precision_of(config.optim))[stage].static_bytes
        rank = torch.distributed.get_rank()
        trained = sum(p.numel() for p in model[0].parameters() if p.requires_grad)
        before = static_bytes(model, optimizer, breakdown=True)
        for chunk in model:  # one step on zero gradients: torch allocates Adam's exp_avg and exp_avg_sq
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        ok, _, _ = optimizer.step()
        assert ok, "the optimizer skipped its step"
        row = {"rank": rank, "params": params, "trained_params": trained, "before_step": before,
               "measured": static_bytes(model, optimizer, breakdown=True), "predicted": predicted,
               "moment_tensors": moment_tensors(optimizer)}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(row))
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
