"""Run by tests/test_save_folder.py under torchrun (2 ranks, DP 2, gloo): failures that strike one rank, which both
must learn of. Each rank writes ``argv[1]/rank<R>.json``: per full-disk case the one line its save raised, the
--save folder's listing after them, the line of a lock held by a live process, and the line of a NaN that rank 1
alone sees."""
import datetime
import errno
import json
import os
import sys

import torch


def replaced_on(rank: int, module: str, owner: str | None, name: str, error):
    """``module[.owner].name`` raising ``error`` on ``rank`` (the original elsewhere); returns how to put it back."""
    import importlib

    holder = importlib.import_module(module)
    holder = getattr(holder, owner) if owner else holder
    original = getattr(holder, name)
    if torch.distributed.get_rank() == rank:
        def fail(*args, **kwargs):
            raise error
        setattr(holder, name, fail)
    return lambda: setattr(holder, name, original)


def main(folder: str) -> None:
    import torch.distributed as dist

    import trainer_parts
    from megatron.training import cpu_compat
    from megatron.training.checkpointing import lock, save_checkpoint
    from megatron.training.finite_check import stop_if_nonfinite
    from megatron.training.initialize import initialize_distributed, set_seeds
    from omnibal_ext.errors import UserError

    full = OSError(errno.ENOSPC, "No space left on device")
    cases = {  # case: (the rank it strikes, the function it replaces: module, class or None, name)
        "common.pt": (0, "megatron.core.dist_checkpointing.strategies.common", "TorchCommonSaveStrategy", "save_common"),
        "shards": (1, "torch.distributed.checkpoint.filesystem", "FileSystemWriter", "write_data"),
        "metadata.json": (0, "megatron.core.dist_checkpointing.serialization", None, "save_config"),
        "manifest": (0, "megatron.training.checkpointing.save", None, "write_json"),
    }
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 1, 1, timeout=datetime.timedelta(seconds=120))
        set_seeds(0)
        rank = dist.get_rank()
        save = os.path.join(folder, "ckpt")
        plan, model, optimizer, scheduler = trainer_parts.build(
            ["--save", save, "--micro-batch-size", "2", "--global-batch-size", "8"], world_size=2)
        save_checkpoint(plan, 1, 8, model, optimizer, scheduler, trainer_parts.NoData())
        out = {}
        for case, (strikes, *where) in cases.items():
            put_back = replaced_on(strikes, *where, full)
            try:
                save_checkpoint(plan, 2, 16, model, optimizer, scheduler, trainer_parts.NoData())
                out[case] = "saved"
            except UserError as e:
                out[case] = str(e)
            finally:
                put_back()
            dist.barrier()
        out["after"] = sorted(os.listdir(save))
        held = os.path.join(folder, "held")
        if rank == 0:  # held by the test's torchrun agent, a live process of this host
            os.makedirs(held)
            with open(os.path.join(held, lock.LOCK), "w") as f:
                f.write(lock.Holder(lock.socket.gethostname(), os.getppid(), "2026-12-03T09:00:00").to_text())
        dist.barrier()
        try:
            with lock.held(held):
                out["lock"] = "taken"
        except UserError as e:
            out["lock"] = f"{type(e).__name__}: {e}"
        try:
            stop_if_nonfinite(7, False, rank == 1)
            out["nan"] = "not stopped"
        except UserError as e:
            out["nan"] = f"{type(e).__name__}: {str(e).split(' (the weights')[0]}"
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
