"""``omnibal generate``: answers to conversations, on the training layout.

    torchrun --nproc-per-node N omnibal_cli.py generate (--hf-checkpoint DIR | --load CKPT --model NAME) \\
        --input IN.jsonl --output OUT.jsonl --max-new-tokens 64 [sampling flags] [the trainer's parallel flags]
    omnibal generate --hf-checkpoint DIR --prompt "What is it?" --image a.png [--video v.mp4] ...

An input line is a ``messages`` record as the trainer reads it, without its final assistant turn (media paths relative
to the input file's folder, as in training data); ``--prompt`` with ``--image`` / ``--video`` makes one such record
(the media before the text, unless the text holds ``<image>`` / ``<video>`` tags). An output line is
``{"text": ..., "token_ids": [...]}``: the new tokens only, one line per request in input order (written by rank 0;
without ``--output``, printed). The input is read and checked with the trainer's reader before the model is built: a
bad line stops the command with one line naming ``file:line``. Sampling flags apply to every request.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from omnibal_ext.errors import UserError

from .requests import SamplingParams


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="answer conversations (messages records) on the training layout",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("requests")
    src.add_argument("--input", metavar="IN.jsonl", default=None, help="messages records, one per line")
    src.add_argument("--prompt", default=None, help="one question (instead of --input)")
    src.add_argument("--image", action="append", default=[], metavar="PATH", help="an image of --prompt (repeatable)")
    src.add_argument("--video", action="append", default=[], metavar="PATH", help="a video of --prompt (repeatable)")
    src.add_argument("--system", default=None, help="a system message for --prompt")
    p.add_argument("--output", metavar="OUT.jsonl", default=None, help="answers, one per request (default: printed)")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=SamplingParams.max_new_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of every request's generator (default: its line's index); --seed is the trainer's")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="a stop token besides the end-of-sequence ones (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence tokens")
    p.set_defaults(func=run_generate, accepts_trainer_flags=True)
    return p


def sampling_of(opts) -> SamplingParams:
    """The command's sampling flags (a ``UserError`` naming the flag when one is out of range)."""
    params = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_p=opts.top_p,
                            top_k=opts.top_k, seed=opts.sampling_seed, stop=tuple(opts.stop),
                            stop_token_ids=tuple(opts.stop_token_id), ignore_eos=opts.ignore_eos)
    try:
        params.check()
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        flag = {"stop_token_ids": "--stop-token-id"}.get(field, "--" + field.replace("_", "-"))
        raise UserError(f"{flag}: {str(e).split(': ', 1)[1]}") from None
    return params


def request_lines(opts) -> tuple[list[str], str, list[str]]:
    """(JSONL lines, the folder their media paths are relative to, each line's name in errors)."""
    if (opts.input is None) == (opts.prompt is None):
        raise UserError("give --input IN.jsonl or --prompt TEXT (one of them)")
    if opts.input is not None:
        if opts.image or opts.video or opts.system:
            raise UserError("--image, --video and --system go with --prompt; --input's records name their own media")
        if not os.path.isfile(opts.input):
            raise UserError(f"--input {opts.input}: no such file")
        with open(opts.input) as f:
            lines = f.read().splitlines()
        return lines, os.path.dirname(os.path.abspath(opts.input)), [f"{opts.input}:{i + 1}" for i in range(len(lines))]
    text = opts.prompt
    tags = "".join("<image>" for _ in opts.image if "<image>" not in text) + \
        "".join("<video>" for _ in opts.video if "<video>" not in text)
    messages = ([{"role": "system", "content": opts.system}] if opts.system else []) + \
        [{"role": "user", "content": tags + text}]
    record = {"messages": messages}
    if opts.image:
        record["images"] = [os.path.abspath(p) for p in opts.image]
    if opts.video:
        record["videos"] = [os.path.abspath(p) for p in opts.video]
    return [json.dumps(record)], os.getcwd(), ["--prompt"]


def run_generate(opts) -> int:
    # the trainer loads here, not when `omnibal` starts (its planner commands are torch-free)
    from megatron.training import cpu_compat
    from megatron.training.arguments import requested_device
    from megatron.training.initialize import choose_device, destroy

    params = sampling_of(opts)
    lines, root, names = request_lines(opts)
    flags = list(opts.trainer_flags)
    with cpu_compat.patched_for(choose_device(requested_device(flags))):  # a CPU run: teardown included
        try:
            return _generate(flags, lines, root, names, params, opts.output)
        finally:
            destroy()


def _generate(flags, lines, root, names, params, output) -> int:
    # (torch and the model load only when a command runs: see run_generate)
    import torch.distributed as dist

    from .build import build_engine, prepare
    from .prompts import read_prompts

    setup = prepare(flags)
    prompts = read_prompts(lines, root, setup.tokenizer, setup.reader, names)  # every problem before the model
    engine = build_engine(setup)
    start = time.perf_counter()
    states = engine.run(prompts, [params] * len(prompts))
    seconds = time.perf_counter() - start
    results = [s.stream.result() for s in states]
    if dist.get_rank() == 0:
        out = "".join(json.dumps({"text": r.text, "token_ids": list(r.token_ids)}) + "\n" for r in results)
        if output:
            with open(output, "w") as f:
                f.write(out)
        else:
            print(out, end="", flush=True)
        tokens = sum(len(r.token_ids) for r in results)
        print(f"> generated {tokens} tokens for {len(results)} request(s) in {seconds:.2f} s "
              f"({tokens / max(seconds, 1e-9):.1f} tokens/s)" + (f" -> {output}" if output else ""), flush=True)
    return 0
