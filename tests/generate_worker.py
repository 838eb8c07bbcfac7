"""Generation cases in one world (``generate_cases.generate_in_pool``: a case of the worker pool of N ranks, or
under torchrun):

    torchrun --nproc-per-node N tests/generate_worker.py CASES.json

CASES.json: a list of cases, each ``{"flags": the trainer's flags (--hf-checkpoint, TP/PP/EP, layout, ...),
"requests": a requests JSONL, "sampling": SamplingParams fields, "forced": a .pt of per-request token lists or null,
"out": a .pt}``, all for the same world size. Each case builds the engine (``megatron.vlm.inference.build``), runs
the requests (and, with ``forced``, teacher-forced with those tokens, keeping each step's logits) and the rank that
broadcasts the tokens (the last stage's TP rank 0 of data-parallel replica 0) writes ``{"tokens", "texts",
"argmax", "gaps", "forced_argmax", "forced_logits", "prompt_ids"}``. Between cases megatron-core's global state is
reset (``initialize.reset_global_state``: every group but the world's destroyed, so that no case's gloo threads
outlive it); the world's process group and the CPU patches stay.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_case(case: dict) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.vlm.inference.build import build_engine, prepare
    from megatron.vlm.inference.prompts import read_prompts
    from megatron.vlm.inference.requests import SamplingParams

    setup = prepare(case["flags"])
    requests = Path(case["requests"])
    lines = requests.read_text().splitlines()
    prompts = read_prompts(lines, str(requests.parent), setup.tokenizer, setup.reader,
                           [f"{requests}:{i + 1}" for i in range(len(lines))])
    engine = build_engine(setup)
    params = [SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in case["sampling"].items()})
              ] * len(prompts)
    states = engine.run(prompts, params)
    teacher = engine.run(prompts, params, forced=torch.load(case["forced"]), diagnostics=True) \
        if case.get("forced") else None
    if dist.get_rank() == engine.link.source and parallel_state.get_data_parallel_rank() == 0:
        out = {"tokens": [s.stream.tokens for s in states], "texts": [s.stream.text for s in states],
               "argmax": [s.argmax for s in states], "gaps": [s.gaps for s in states],
               "prompt_ids": [s.prompt.sample["input_ids"].tolist() for s in states]}
        if teacher is not None:
            out["forced_argmax"] = [s.argmax for s in teacher]
            out["forced_logits"] = [torch.stack(s.logits) for s in teacher]
        torch.save(out, case["out"])


def main(argv: list[str]) -> int:
    """``argv``: [CASES.json] (a worker pool's case calls it so; the command line too)."""
    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, reset_global_state

    cases = json.loads(Path(argv[0]).read_text())
    with cpu_compat.patched():
        try:
            for k, case in enumerate(cases):
                try:
                    run_case(case)
                except Exception:
                    print(f"generate_worker: case {k} ({' '.join(case['flags'])}) failed", flush=True)
                    raise
                reset_global_state()
        finally:
            destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
