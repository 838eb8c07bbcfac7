"""``omnibal serve`` and ``omnibal eval``: their flags, and what each runs (docs/generation.md, Serving and
Evaluation).  Only argparse is imported here: the server stack, torch and the model load when a command runs, so
that ``omnibal``'s planner commands start without them."""
from __future__ import annotations

import argparse
import os
import tempfile

from omnibal_ext.errors import UserError


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal serve``: an OpenAI-compatible server of a model on the training layout."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions)",
        description="Serve a model over an OpenAI-compatible HTTP API: POST /v1/chat/completions (text, image_url "
                    "and video_url parts; data URLs and local paths; stream: true for server-sent events), GET "
                    "/v1/models, GET /health. The model comes from the trainer's flags (--hf-checkpoint DIR, or "
                    "--load CKPT with --model NAME), on the layout of its parallel flags under torchrun: rank 0 "
                    "serves, the other ranks follow it. Concurrent requests are generated in batches. Listens on "
                    "loopback unless --host says otherwise.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one; default: %(default)s)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name requests give as 'model' (default: the --hf-checkpoint folder's name, else --model)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests generated together (default: %(default)s)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests waiting for a batch beyond it; more are answered 429 (default: %(default)s)")
    p.add_argument("--default-max-new-tokens", type=int, default=256,
                   help="answer length when a request gives no max_tokens (default: %(default)s; at most what "
                        "--seq-length leaves after the prompt)")
    p.add_argument("--media-dir", default=None, metavar="DIR",
                   help="where data-URL media are written while their request runs (default: the system's "
                        "temporary folder)")
    p.add_argument("--keep-alive-s", type=int, default=75, metavar="S",
                   help="seconds an idle connection stays open; keep it above the clients' and any load balancer's "
                        "own idle timeout, so that they close first (default: %(default)s)")
    p.set_defaults(func=run_serve, accepts_trainer_flags=True)
    return p


def run_serve(opts: argparse.Namespace) -> int:
    # the server stack and the trainer load here, not when `omnibal` starts (its planner commands need neither)
    from megatron.training import cpu_compat
    from megatron.training.arguments import requested_device
    from megatron.training.initialize import choose_device, destroy
    from megatron.vlm.inference.server import ServerConfig, bind_listener

    for flag, value in (("--max-batch-size", opts.max_batch_size), ("--max-waiting", opts.max_waiting),
                        ("--default-max-new-tokens", opts.default_max_new_tokens),
                        ("--keep-alive-s", opts.keep_alive_s)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if not 0 <= opts.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {opts.port}")
    config = ServerConfig(opts.host, opts.port, opts.max_batch_size, opts.max_waiting, opts.media_dir,
                          opts.keep_alive_s)
    flags = list(opts.trainer_flags)
    # rank 0 takes its port before the model loads: a port in use is refused before minutes of loading
    listener = bind_listener(opts.host, opts.port) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        with cpu_compat.patched_for(choose_device(requested_device(flags))):  # a CPU run: teardown included
            try:
                _serve(flags, config, listener, opts.served_model_name, opts.default_max_new_tokens)
            finally:
                destroy()
    finally:
        if listener is not None:
            listener.close()
    return 0


def _serve(flags: list[str], config, listener, name: str | None, default_max_new_tokens: int) -> None:
    from megatron.vlm.inference.build import build_engine, prepare
    from megatron.vlm.inference.server import serve_layout

    setup = prepare(flags)  # the trainer's checks and generation's refusals, before the model is built
    hf = setup.plan.config.model.hf_checkpoint
    name = name or (os.path.basename(os.path.normpath(hf)) if hf else setup.plan.config.model.spec.name)
    model = served_model(setup, name, default_max_new_tokens)
    engine = build_engine(setup)
    serve_layout(engine, model, config, listener=listener, on_listening=lambda url: print(
        f"omnibal serve: {name} at {url}/v1 (Ctrl-C stops)", flush=True))


def served_model(setup, name: str, default_max_new_tokens: int):
    """The ``ServedModel`` of a generation setup (``build.prepare``): ``--seq-length`` tokens per sequence, and a
    request's prompt length as the engine's reader makes it (the trainer's reader: chat template, image and video
    tokens), read with a copy of the setup's tokenizer (the HTTP threads count while the engine decodes)."""
    import copy
    import json

    from megatron.vlm.inference.prompts import read_prompts
    from megatron.vlm.inference.server import ServedModel

    tokenizer = copy.deepcopy(setup.tokenizer)

    def count_prompt_tokens(request) -> int:
        return read_prompts([json.dumps(request.record())], "/", tokenizer, setup.reader, ["the request"])[0].length

    return ServedModel(name, setup.plan.config.data.seq_length, count_prompt_tokens, default_max_new_tokens)


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal eval``: a local task answered by a running ``omnibal serve``, scored by exact match."""
    p = subparsers.add_parser(
        "eval", help="evaluate a running `omnibal serve` on a local task (exact match)",
        description="Evaluate a running `omnibal serve` on a local task: a JSONL of the trainer's records (`messages` "
                    "or `conversations`; media paths relative to the file), each assistant turn an answer asked "
                    "with the turns before it. The answers are asked greedily over the server's OpenAI-compatible "
                    "API, by this process (--backend omnibal) or by lmms-eval run from its own Python environment "
                    "(--backend lmms-eval), and scored by exact match (case, punctuation and outer whitespace "
                    "ignored); a record is right when all its answers are.")
    p.add_argument("--task", required=True, metavar="TASK.jsonl", help="the local task")
    p.add_argument("--server", default="http://127.0.0.1:8000", metavar="URL",
                   help="the server's base URL (default: %(default)s)")
    p.add_argument("--served-model", default=None, metavar="NAME",
                   help="the model name to ask for (default: the one model the server lists)")
    p.add_argument("--backend", choices=("omnibal", "lmms-eval"), default="omnibal",
                   help="who asks the questions (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer length limit (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: %(default)s)")
    p.add_argument("--media", choices=("data-url", "path"), default="data-url",
                   help="--backend omnibal: send media as data URLs, or as paths for a server on this machine "
                        "(default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="the first N records only")
    p.add_argument("--output", default=None, metavar="REPORT.json", help="write the report (and predictions) here")
    p.add_argument("--lmms-eval-python", default=None, metavar="PYTHON",
                   help="--backend lmms-eval: the interpreter of lmms-eval's own environment (VENV/bin/python)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="--backend lmms-eval: where the task, lmms-eval's log and results go (default: a new "
                        "temporary folder)")
    p.set_defaults(func=run_eval)
    return p


def run_eval(opts: argparse.Namespace) -> int:
    from megatron.vlm.inference.eval_task import read_task
    from megatron.vlm.inference.evaluate import evaluate_with_client, served_model_of, write_report

    if opts.max_new_tokens < 1 or opts.concurrency < 1 or (opts.limit is not None and opts.limit < 1):
        raise UserError("--max-new-tokens, --concurrency and --limit must be >= 1")
    lmms = opts.backend == "lmms-eval"
    if not lmms and (opts.lmms_eval_python or opts.work_dir):
        raise UserError("--lmms-eval-python and --work-dir go with --backend lmms-eval")
    if lmms and opts.lmms_eval_python is None:
        raise UserError("--backend lmms-eval needs --lmms-eval-python VENV/bin/python (lmms-eval's own environment)")
    samples = read_task(opts.task, opts.limit)
    if lmms:
        from megatron.vlm.inference.lmms_eval_task import LmmsEvalRun, run_lmms_eval

        work_dir = opts.work_dir or tempfile.mkdtemp(prefix="omnibal-lmms-eval-")
        run = LmmsEvalRun(opts.lmms_eval_python, work_dir, opts.concurrency)
        model = opts.served_model or served_model_of(opts.server)
        report = run_lmms_eval(samples, opts.task, opts.server, model, run, opts.max_new_tokens)
        print(f"lmms-eval's task, log and results: {os.path.abspath(work_dir)}")
    else:
        report = evaluate_with_client(samples, opts.server, opts.task, opts.served_model, opts.max_new_tokens,
                                      opts.concurrency, opts.media)
    print(report.summary())
    if opts.output:
        write_report(report, opts.output)
        print(f"report written to {opts.output}")
    return 0
