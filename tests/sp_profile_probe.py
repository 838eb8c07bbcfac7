"""Run under torchrun (2 processes): profile one ViT and one LLM layer of the tiny model at TP 2, with and
without sequence parallelism, and write the measured activation bytes (rank 0) as JSON to argv[1]. Optional
argv[2], argv[3]: another preset and its micro-batch shape (``MicroBatchShape.to_dict`` as JSON).

Used by tests/test_sequence_parallel.py and tests/test_qwen2_5_vl_profile.py (one launch measures both)."""
import json
import sys

import torch

from megatron.training import cpu_compat
from megatron.training.flags import build_parser
from megatron.training.specs import run_config
from megatron.training.initialize import initialize_distributed, set_seeds
from megatron.training.profiling import profile_units
from omnibal_ext.model.cost_model import MicroBatchShape
from omnibal_ext.model.units import get_preset

SHAPE = MicroBatchShape(vision_items=6, llm_tokens=301, dtype_bytes=4, llm_attn_tokens_sq=301 * 60.0)


def main(path: str, preset: str = "tiny", shape: MicroBatchShape = SHAPE) -> None:
    spec = get_preset(preset)
    out = {"shape": shape.to_dict()}
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 2, 1)
        set_seeds(1)
        for sp in (False, True):
            args = build_parser().parse_args(["--tensor-model-parallel-size", "2", "--seed", "1", "--transformer-impl",
                                              "local"] + (["--sequence-parallel"] if sp else []))
            table = profile_units(run_config(args, 1), spec, shape, 263, torch.device("cpu"), warmup=0, repeats=1)
            out["sp" if sp else "tp"] = {u.kind: {"act_bytes": u.act_bytes, "act_bytes_full": u.act_bytes_full,
                                                   "act_bytes_selective": u.act_bytes_selective}
                                         for u in table.units}
    if torch.distributed.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(out, f)


def launch(workdir, preset: str | None = None, shape: MicroBatchShape | None = None) -> dict:
    """Run this probe under torchrun (2 processes, in ``workdir``) and return what it measured (``main``'s
    JSON); ``preset``/``shape``: another model and micro-batch than the tiny model at ``SHAPE``."""
    import subprocess
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import benchlib

    out = Path(workdir) / "probe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(benchlib.free_port()), __file__, str(out)]
    if preset is not None:
        cmd += [preset, json.dumps(shape.to_dict())]
    run = subprocess.run(cmd, cwd=workdir, env=benchlib.trainer_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


if __name__ == "__main__":
    other = (sys.argv[2], MicroBatchShape.from_dict(json.loads(sys.argv[3]))) if len(sys.argv) > 2 else ()
    main(sys.argv[1], *other)
