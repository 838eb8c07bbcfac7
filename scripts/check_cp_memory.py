"""Measured activation bytes of one context-parallel rank against the memory model (``MicroBatchShape.cp``).

    torchrun --nproc-per-node 2 scripts/check_cp_memory.py --context-parallel-size 2
    python scripts/check_cp_memory.py                     # CP 1, for comparison

The whole tiny model as one stage (fp32, CPU), one packed micro-batch (``--tiles`` tiles, ``--tokens`` LLM tokens
in samples of ``--sample`` tokens), split by the collate's CP split; the bytes autograd saves in the forward
(``ActivationMeter``) against the analytic components' sum at the same shape on the CPU's kernels
(``DEVICES["cpu"]``).  Prints one JSON line per rank (tests/test_cp_memory.py reads them).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--model", default="tiny")
    p.add_argument("--tiles", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--sample", type=int, default=256)
    a = p.parse_args(argv)
    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, initialize_distributed, set_seeds
    from megatron.training.memory import ActivationMeter
    from megatron.training.profiling import synthetic_batch
    from megatron.vlm.parallel.context_parallel import split_batch
    from megatron.vlm.stage.micro_batch import MicroBatch
    from megatron.vlm.stage.build import StageBuild, build_stage
    from omnibal_ext.model.cost_model import DEVICES, analytic_costs
    from omnibal_ext.model.shape import MicroBatchShape
    from omnibal_ext.model.units import build_units, get_preset

    cp = a.context_parallel_size
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 1, 1, cp)
        set_seeds(7)
        from megatron.core import parallel_state

        spec = get_preset(a.model)
        img = spec.language.vocab_size - 1  # no random text token (ids < 256) is an image-context token
        stage = build_stage(StageBuild(spec, range(len(build_units(spec))), img_context_id=img, cp=cp)).train()
        shape = MicroBatchShape(a.tiles, a.tokens, 4, llm_attn_tokens_sq=float(a.tokens * a.sample))
        fields = {**synthetic_batch(spec, shape, img, torch.device("cpu")).fields(),
                  "sample_tiles": torch.tensor([a.tiles])}
        if cp > 1:
            fields = split_batch(fields, cp, parallel_state.get_context_parallel_rank(), 0, img)
        batch = MicroBatch.of(fields)
        meter = ActivationMeter(stage)
        with meter.measure():
            out = stage(batch)
        out.loss.sum().backward()
        costs = analytic_costs(spec, MicroBatchShape(a.tiles, a.tokens, 4, float(a.tokens * a.sample), cp=cp),
                               device=DEVICES["cpu"], attention="flash")
        predicted = sum(u.act_bytes for u in costs.units)
        measured = meter.per_microbatch[0]
        print(json.dumps({"cp": cp, "rank": dist.get_rank(), "measured_bytes": measured, "predicted_bytes": predicted,
                          "error": predicted / measured - 1}), flush=True)
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
