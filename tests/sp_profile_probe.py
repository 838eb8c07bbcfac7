"""Run under torchrun (2 processes): profile one ViT and one LLM layer of the tiny model at TP 2, with and
without sequence parallelism, and write the measured activation bytes (rank 0) as JSON to argv[1].

Used by tests/test_sequence_parallel.py (one launch measures both)."""
import json
import sys
from types import SimpleNamespace

import torch

from megatron.training import cpu_compat
from megatron.training.initialize import initialize_distributed, set_seeds
from megatron.training.profiling import profile_units
from omnibal_ext.model.cost_model import MicroBatchShape
from omnibal_ext.model.units import get_preset

SHAPE = MicroBatchShape(vision_items=6, llm_tokens=301, dtype_bytes=4, llm_attn_tokens_sq=301 * 60.0)


def main(path: str) -> None:
    spec = get_preset("tiny")
    out = {"shape": SHAPE.to_dict()}
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 2, 1)
        set_seeds(1)
        for sp in (False, True):
            args = SimpleNamespace(tensor_model_parallel_size=2, bf16=False, seed=1, sequence_parallel=sp,
                                   attention_backend="auto", transformer_impl="local")
            table = profile_units(args, spec, SHAPE, 263, torch.device("cpu"), warmup=0, repeats=1)
            out["sp" if sp else "tp"] = {u.kind: {"act_bytes": u.act_bytes, "act_bytes_full": u.act_bytes_full}
                                         for u in table.units}
    if torch.distributed.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
