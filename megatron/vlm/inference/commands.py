"""``omnibal serve`` and ``omnibal eval``: their flags, and what each runs (docs/generation.md, Serving and
Evaluation).  Only argparse is imported here: the server stack, torch and the model load when a command runs, so
that ``omnibal``'s planner commands start without them."""
from __future__ import annotations

import argparse
import os
import tempfile


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal eval``: a local task answered by a running ``omnibal serve``, scored by exact match."""
    p = subparsers.add_parser(
        "eval", help="evaluate a running `omnibal serve` on a local task (exact match)",
        description="Evaluate a running `omnibal serve` on a local task: a `messages` JSONL whose records end with "
                    "the reference answer (media paths relative to the file). The answers are asked greedily over "
                    "the server's OpenAI-compatible API, by this process (--backend omnibal) or by lmms-eval run "
                    "from its own Python environment (--backend lmms-eval), and scored by exact match (case, "
                    "punctuation and outer whitespace ignored).")
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
    p.add_argument("--limit", type=int, default=None, help="the first N samples only")
    p.add_argument("--output", default=None, metavar="REPORT.json", help="write the report (and predictions) here")
    p.add_argument("--lmms-eval-python", default=None, metavar="PYTHON",
                   help="--backend lmms-eval: the interpreter of lmms-eval's own environment (VENV/bin/python)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="--backend lmms-eval: where the task, lmms-eval's log and results go (default: a new "
                        "temporary folder)")
    p.set_defaults(func=run_eval)
    return p


def run_eval(args: argparse.Namespace) -> int:
    from megatron.vlm.inference.eval_task import read_task
    from megatron.vlm.inference.evaluate import evaluate_with_client, served_model_of, write_report
    from omnibal_ext.errors import UserError

    if args.max_new_tokens < 1 or args.concurrency < 1 or (args.limit is not None and args.limit < 1):
        raise UserError("--max-new-tokens, --concurrency and --limit must be >= 1")
    lmms = args.backend == "lmms-eval"
    if not lmms and (args.lmms_eval_python or args.work_dir):
        raise UserError("--lmms-eval-python and --work-dir go with --backend lmms-eval")
    if lmms and args.lmms_eval_python is None:
        raise UserError("--backend lmms-eval needs --lmms-eval-python VENV/bin/python (lmms-eval's own environment)")
    samples = read_task(args.task, args.limit)
    if lmms:
        from megatron.vlm.inference.lmms_eval_task import LmmsEvalRun, run_lmms_eval

        work_dir = args.work_dir or tempfile.mkdtemp(prefix="omnibal-lmms-eval-")
        run = LmmsEvalRun(args.lmms_eval_python, work_dir, args.concurrency)
        model = args.served_model or served_model_of(args.server)
        report = run_lmms_eval(samples, args.task, args.server, model, run, args.max_new_tokens)
        print(f"lmms-eval's task, log and results: {os.path.abspath(work_dir)}")
    else:
        report = evaluate_with_client(samples, args.server, args.task, args.served_model, args.max_new_tokens,
                                      args.concurrency, args.media)
    print(f"{report.backend}: {report.correct}/{report.samples} right, exact-match accuracy {report.accuracy:.4f} "
          f"on {args.task}")
    if args.output:
        write_report(report, args.output)
        print(f"report written to {args.output}")
    return 0
