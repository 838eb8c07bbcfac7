"""Run on 2 ranks (``launch``: the worker pool of 2): profile one ViT and one LLM layer of the tiny model at TP 2, with
and without sequence parallelism, and write the measured activation bytes (rank 0) as JSON to argv[0]. Optional
argv[1], argv[2]: another preset and its micro-batch shape (``MicroBatchShape.to_dict`` as JSON).

Used by tests/test_sequence_parallel.py and tests/test_qwen2_5_vl_profile.py (one launch measures both)."""
import json
import sys

import torch

from megatron.training import cpu_compat
from megatron.training.flags import build_parser
from megatron.training.initialize import destroy, initialize_distributed, set_seeds
from megatron.training.profiling import profile_units
from megatron.training.specs import run_config
from omnibal_ext.model.cost_model import MicroBatchShape
from omnibal_ext.model.units import get_preset

SHAPE = MicroBatchShape(vision_items=6, llm_tokens=301, dtype_bytes=4, llm_attn_tokens_sq=301 * 60.0)


def main(argv: list[str]) -> int:
    path = argv[0]
    preset, shape = (argv[1], MicroBatchShape.from_dict(json.loads(argv[2]))) if len(argv) > 1 else ("tiny", SHAPE)
    spec = get_preset(preset)
    out = {"shape": shape.to_dict()}
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 2, 1)
        set_seeds(1)
        for sp in (False, True):
            args = build_parser().parse_args(["--tensor-model-parallel-size", "2", "--seed", "1", "--transformer-impl",
                                              "local"] + (["--sequence-parallel"] if sp else []))
            table = profile_units(run_config(args, 2), spec, shape, 263, torch.device("cpu"), warmup=0, repeats=1)
            out["sp" if sp else "tp"] = {u.kind: {"act_bytes": u.act_bytes, "act_bytes_full": u.act_bytes_full,
                                                   "act_bytes_selective": u.act_bytes_selective}
                                         for u in table.units}
        if torch.distributed.get_rank() == 0:
            with open(path, "w") as f:
                json.dump(out, f)
        destroy()
    return 0


def launch(workdir, preset: str | None = None, shape: MicroBatchShape | None = None) -> dict:
    """Run this probe on 2 ranks (the worker pool, in ``workdir``) and return what it measured (``main``'s JSON);
    ``preset``/``shape``: another model and micro-batch than the tiny model at ``SHAPE``."""
    from pathlib import Path

    import pool

    out = Path(workdir) / "probe.json"
    argv = [str(out)] + ([preset, json.dumps(shape.to_dict())] if preset is not None else [])
    run = pool.run_case("sp_profile_probe:main", argv, 2, workdir)
    assert run.returncode == 0, run.output[-4000:]
    return json.loads(out.read_text())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
