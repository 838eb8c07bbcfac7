"""The generation engine called directly, in a world of one: ``python engine_answers.py REQUESTS.json OUT.json
[trainer flags]`` answers each request of REQUESTS.json (``[{"messages": [...], "max_new_tokens": N}]``, greedy) in
one ``generate`` call and writes ``[{"token_ids": [...], "text": ...}]`` (the oracle of the server's end-to-end
test)."""
from __future__ import annotations

import json
import sys

from megatron.training import cpu_compat
from megatron.training.initialize import destroy
from megatron.vlm.inference.build import generator_from_args
from megatron.vlm.inference.requests import GenerationRequest, SamplingParams


def main(requests_path: str, out_path: str, flags: list[str]) -> None:
    with open(requests_path) as f:
        asked = json.load(f)
    with cpu_compat.patched():
        try:
            engine = generator_from_args(flags, world_size=1)
            results = engine.generate([GenerationRequest(tuple(r["messages"]), SamplingParams(r["max_new_tokens"]))
                                       for r in asked])
        finally:
            destroy()
    with open(out_path, "w") as f:
        json.dump([{"token_ids": list(r.token_ids), "text": r.text} for r in results], f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
