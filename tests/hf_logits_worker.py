"""scripts/hf_logits.py at several cases in one torchrun world (``hf_check.torchrun_logits``):

    torchrun --nproc-per-node N tests/hf_logits_worker.py CASES.json

CASES.json: a list of hf_logits.py argument lists (each its own --hf-checkpoint, --out, TP/PP/EP flags, layout), all
for the same world size. Each case runs the script's own ``main``; between cases only megatron's model-parallel
groups are torn down (``destroy_model_parallel``), the world's process group stays (a new one in the same
processes would reuse torch's store keys), and the CPU patches stay installed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))


def main(cases_file: str) -> int:
    import hf_logits

    from megatron.core import parallel_state
    from megatron.training import cpu_compat, initialize

    cases = json.loads(Path(cases_file).read_text())
    destroy = initialize.destroy
    with cpu_compat.patched():
        try:
            for k, argv in enumerate(cases):
                # hf_logits.main tears the world down at its end: all but the last case keep the process group
                initialize.destroy = destroy if k == len(cases) - 1 else parallel_state.destroy_model_parallel
                code = hf_logits.main(argv)
                if code:
                    print(f"hf_logits_worker: case {k} ({' '.join(argv)}) failed", flush=True)
                    return code
        finally:
            initialize.destroy = destroy
            destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
