"""Cases that exercise a worker pool itself (tests/test_pool.py): ``pool_probe:main COMMAND [OUT]``.

* ``dirty``: leaves behind what a careless case could: an environment variable, another working directory, float64
  as the default dtype, two threads, grad mode off, a plugin family registered, megatron's model-parallel groups
  (TP2) and its RNG tracker seeded, a process group of its own;
* ``inspect OUT``: writes what the process holds of those (JSON, rank 0), and its threads' count and names (a
  process group that outlives its run keeps its gloo threads);
* ``fail RANK``: raises on that rank only, the others wait in a barrier (a bug on one rank);
* ``user-error``: a ``UserError`` on every rank;
* ``die RANK``: that rank exits at once (os._exit), the others wait in a barrier.
"""
from __future__ import annotations

import json
import os
import sys

import pool_worker


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    command = argv[0]
    rank = dist.get_rank()
    if command == "dirty":
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        import toy_family  # noqa: F401  (registers its family)

        os.environ["OMNIBAL_POOL_PROBE"] = "dirty"
        os.chdir("/")
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(2)
        torch.set_grad_enabled(False)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
        from megatron.training import cpu_compat

        with cpu_compat.patched():  # megatron-core's seeding asks for CUDA's generator
            model_parallel_cuda_manual_seed(11)
        dist.new_group(list(range(dist.get_world_size())), backend="gloo")
        return 0
    if command == "inspect":
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.vlm.families import FAMILIES

        state = {"env": os.environ.get("OMNIBAL_POOL_PROBE"), "cwd": os.getcwd(), "dtype": str(torch.get_default_dtype()),
                 "threads": torch.get_num_threads(), "grad": torch.is_grad_enabled(),
                 "families": sorted(FAMILIES),
                 "toy_imported": "toy_family" in sys.modules,
                 "model_parallel": parallel_state.model_parallel_is_initialized(),
                 "rng_states": sorted(get_cuda_rng_tracker().get_states()),
                 "groups": len(dist.distributed_c10d._world.pg_map),
                 "os_threads": pool_worker.os_threads(), "os_thread_names": pool_worker.os_thread_names()}
        if rank == 0:
            with open(argv[1], "w") as f:
                json.dump(state, f)
        return 0
    if command == "fail":
        if rank == int(argv[1]):
            raise RuntimeError(f"a bug on rank {rank}")
        dist.barrier()
        return 0
    if command == "user-error":
        from omnibal_ext.errors import UserError, report

        try:
            raise UserError("--probe 0: must be >= 1")
        except UserError as e:
            return report(e)
    if command == "die":
        if rank == int(argv[1]):
            os._exit(3)
        dist.barrier()
        return 0
    raise ValueError(f"pool_probe: no command {command!r}")
