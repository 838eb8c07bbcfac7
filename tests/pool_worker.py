"""One rank of a test worker pool (``tests/pool.py``): imports the trainer once, joins the pool's world, then runs
cases one after the other in this same process until its standard input closes.

    python -u tests/pool_worker.py serve POOL_DIR    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the pool)
    python -u tests/pool_worker.py zygote            (forks such ranks on request, its imports done once: ``zygote``)
    python tests/pool_worker.py call MODULE:FUNCTION ARG...     (one case in a fresh process: its exit status)

A case is one JSON line on standard input: ``{"id": N, "target": "module:function", "argv": [...], "cwd": DIR,
"env": {...}}``. The rank runs ``function(argv)`` (an int exit status or None, as a command's ``main`` returns;
``SystemExit`` counts as its code, any other exception prints its traceback and counts as 1) with its file
descriptors 1 and 2 in ``POOL_DIR/case<N>.rank<R>.out`` and ``.err``, and writes ``{"returncode": rc, "threads":
the OS threads it holds after the case}`` to ``POOL_DIR/case<N>.rank<R>.json`` when done. Around every case it puts
the process back as it found it (``CaseState``): megatron-core's global state (``initialize.reset_global_state``),
torch's seeds, default dtype, threads and grad mode, the registered families, the modules a case imported from
outside the installed packages (plugin families), the environment, ``sys.path``, ``sys.argv`` and the working
directory. The world's process group lives as long as the rank (``initialize.hold_world``: the entry points' teardown
keeps it).
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import random
import signal
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for path in (str(TESTS), str(ROOT / "scripts"), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

# what the entry points import lazily, imported once here (the 6-7 s every fresh trainer process pays)
WARM = ("pretrain_vlm", "megatron.training.arguments", "megatron.training.training", "megatron.training.setup",
        "megatron.training.checkpointing", "megatron.training.profiling", "megatron.training.isf",
        "megatron.training.tokenizer_setup", "megatron.training.hf_checkpoints", "megatron.vlm.families",
        "megatron.vlm.hf.convert", "megatron.vlm.hf.load", "megatron.vlm.hf.logits", "hf_logits", "omnibal_cli")
# modules a case may import and that stay: the installed packages, the standard library and the project's own
KEPT_ROOTS = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                                     sysconfig.get_paths()["stdlib"]})
PROJECT_PACKAGES = ("megatron", "omnibal_ext", "pretrain_vlm", "omnibal_cli", "benchlib", "hf_logits")


@dataclass(frozen=True)
class CaseState:
    """What a case may change in the process, taken before it and put back after it."""

    environ: dict
    cwd: str
    path: list
    argv: list
    modules: frozenset
    families: object  # family_registry.snapshot()
    dtype: object
    threads: int
    grad: bool

    @classmethod
    def take(cls) -> "CaseState":
        import torch

        import family_registry

        return cls(dict(os.environ), os.getcwd(), list(sys.path), list(sys.argv), frozenset(sys.modules),
                   family_registry.snapshot(), torch.get_default_dtype(), torch.get_num_threads(),
                   torch.is_grad_enabled())

    def restore(self) -> None:
        import numpy as np
        import torch

        import family_registry
        from megatron.training import cpu_compat, initialize

        initialize.reset_global_state()
        gc.collect()  # the case's model, optimizer and groups (reference cycles): their gloo threads end with them
        empty_leaked_modules(torch.nn.Module)
        if cpu_compat.active():  # a case that left its patches on (an exception between enter and exit)
            raise RuntimeError("a case left megatron.training.cpu_compat's patches in place")
        family_registry.restore(self.families)
        for name in set(sys.modules) - self.modules:
            if not _kept(name):
                del sys.modules[name]
        importlib.invalidate_caches()
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        sys.path[:] = self.path
        sys.argv[:] = self.argv
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(self.grad)
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)


def empty_leaked_modules(module_type: type) -> None:
    """Empty the megatron modules (instances of ``module_type``) still alive after a case's collection, and collect
    again.

    megatron-core 0.16.1's MoE layers outlive their run: the token dispatcher keeps the last forward's ``probs``,
    whose autograd graph (C++, out of the collector's sight) reaches the DDP model's gradient-accumulator hooks,
    whose closures hold the model. The model, its optimizer and its process groups would stay, with three gloo
    threads per group that wake while idle (about 48 threads and 10% of a core per MoE case on two ranks). An
    emptied module holds nothing: what it held is freed with the graph, and the module itself is a shell."""
    leaked = [o for o in gc.get_objects()
              if isinstance(o, module_type) and type(o).__module__.startswith("megatron.")]
    for module in leaked:
        module.__dict__.clear()
    if leaked:
        gc.collect()


def _kept(module: str) -> bool:
    """Whether a module a case imported stays for the next cases: the project's and installed packages do (their
    import is what the pool saves); a plugin module (``--family-module``, a test's own module) goes, so that the next
    case naming it imports it again and registers its family again."""
    if module.split(".")[0] in PROJECT_PACKAGES:
        return True
    file = getattr(sys.modules.get(module), "__file__", None)
    return file is None or str(Path(file).resolve()).startswith(KEPT_ROOTS)


@contextlib.contextmanager
def output_to(out: Path, err: Path):
    """File descriptors 1 and 2 (and Python's sys.stdout/stderr over them) written to ``out`` and ``err``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as fo, open(err, "w") as fe:
        os.dup2(fo.fileno(), 1)
        os.dup2(fe.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def call(target: str, argv: list[str]) -> int:
    """``module:function`` called on ``argv``: its exit status (an int it returns; anything else: 0; SystemExit: its
    code; an exception: its traceback printed, 1)."""
    module, function = target.split(":")
    try:
        result = getattr(importlib.import_module(module), function)(list(argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the case's failure is reported to its test, the rank serves the next case
        traceback.print_exc()
        return 1
    return result if isinstance(result, int) else 0  # a main that returns its results (a dict) succeeded


def run(case: dict, pool_dir: Path, rank: int) -> int:
    """One case, the process put back as it was afterwards."""
    state, code = CaseState.take(), 1
    name = f"case{case['id']}.rank{rank}"
    with output_to(pool_dir / f"{name}.out", pool_dir / f"{name}.err"):
        try:
            os.environ.update(case["env"])
            sys.path[:0] = [p for p in case["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            os.chdir(case["cwd"])
            sys.argv[:] = [case["target"], *case["argv"]]
            code = call(case["target"], case["argv"])
        finally:
            try:
                state.restore()
            except BaseException:
                traceback.print_exc()
                code = code or 1
    return code


def os_thread_names() -> list[str]:
    """The names of this process's OS threads, sorted (gloo's: ``gloo_tcp_loop``, ``pt_gloo_runloop``; empty where
    there is no /proc to read them in)."""
    if not os.path.isdir("/proc/self/task"):
        return []
    names = []
    for thread in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # it ended meanwhile
            pass
    return sorted(names)


def os_threads() -> int:
    """The OS threads of this process (0 where there is no /proc to count them in)."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def die_with_parent() -> None:
    """On Linux, have the kernel kill this rank when the process that started the pool dies (a test session killed
    mid-case leaves no ranks behind); elsewhere the closed standard input ends the rank after its case."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def import_warm() -> None:
    """The modules every case needs, imported once (no thread is started: a zygote may fork after them)."""
    for module in WARM:
        importlib.import_module(module)
    import family_registry  # noqa: F401  (CaseState's)
    import frozen_heap  # noqa: F401


def serve(pool_dir: str) -> int:
    """Join the pool's world (``RANK`` ... from the environment) and run the cases read from the standard input until
    it closes."""
    die_with_parent()
    import torch
    import torch.distributed as dist

    import frozen_heap
    from megatron.training import initialize

    pool_dir = Path(pool_dir)
    rank = int(os.environ["RANK"])
    import_warm()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=initialize.DEFAULT_TIMEOUT)
    frozen_heap.keep_frozen_through_energon()
    frozen_heap.freeze_survivors()  # the imports: each collection after a case scans only what cases made
    (pool_dir / f"ready.rank{rank}").write_text("")
    with initialize.hold_world():
        for line in sys.stdin:
            case = json.loads(line)
            code = run(case, pool_dir, rank)
            done = pool_dir / f"case{case['id']}.rank{rank}.json"
            done.with_suffix(".tmp").write_text(json.dumps({"returncode": code, "threads": os_threads()}))
            done.with_suffix(".tmp").rename(done)
    dist.destroy_process_group()
    return 0


def zygote() -> int:
    """Start ranks by forking this process, which has imported what a rank imports (``import_warm``): a rank then
    starts in milliseconds instead of the 6-7 s of its imports (tests/pool.py: ``Zygote``).

    Reads one JSON request per line on its standard input, ``{"env": {...}, "cwd": DIR, "log": FILE, "cases": FIFO,
    "pool_dir": DIR, "exit": FILE}``, forks, and writes the child's pid as a line on its standard output. The child
    takes ``env`` as its whole environment, writes its output to ``log``, has the named pipe ``cases`` as its
    standard input and serves the cases (``serve``). When a child ends, its exit status (a negative signal number
    when killed, as ``subprocess`` reports it) is written to its ``exit`` file. Ends when its standard input closes;
    the kernel kills it and its children when the process that started it dies."""
    die_with_parent()
    import_warm()
    gc.collect()
    gc.freeze()  # the imports' objects stay shared with the children (a collection would write to their pages)
    if os_threads() > 1:
        raise RuntimeError(f"zygote: {os_thread_names()} threads after the imports; forking would copy a lock held")
    exits: dict[int, str] = {}

    def reap(signum, frame):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            path = exits.pop(pid, None)
            if path:
                Path(path + ".tmp").write_text(str(code))
                os.replace(path + ".tmp", path)

    signal.signal(signal.SIGCHLD, reap)
    requests = os.fdopen(os.dup(0), "r")  # unbuffered reads would not matter: children never read it
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # the pid is recorded before its end is reaped
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            code = 1
            try:
                requests.close()
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
                cases = os.open(request["cases"], os.O_RDONLY)  # a named pipe: waits for the pool to open its end
                os.dup2(cases, 0)  # sys.stdin reads it (the zygote never read from its own sys.stdin: nothing buffered)
                os.close(cases)
                code = serve(request["pool_dir"])
            except BaseException:  # noqa: BLE001 - the rank's failure goes to its log, its status to the pool
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        exits[pid] = request["exit"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        print(pid, flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2]))
    if sys.argv[1] == "zygote":
        sys.exit(zygote())
    sys.exit(call(sys.argv[2], sys.argv[3:]))
