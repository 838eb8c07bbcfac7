"""Persistent worker pools of 1, 2 and 4 ranks: multi-process test cases without a new process per case.

A fresh ``torchrun pretrain_vlm.py`` pays about 6.6 s per rank importing the trainer before it trains a few
iterations. A pool starts its ranks once (``tests/pool_worker.py``: forked from the session's ``Zygote``, which did
those imports once, then one gloo world) and runs each case in them: ``pool(nproc).run("pretrain_vlm:cli", argv,
cwd)`` calls the entry point in every rank, as torchrun would start it, and returns its exit status and the ranks'
output in rank order (what ``benchlib.launch_ranks`` returns for a fresh launch). Between cases each rank puts its
process back as it found it (``pool_worker.CaseState``).

A case that fails returns its status and output (a traceback, or the ``error: ...`` line of a ``UserError``). A rank
that dies, or a failed rank whose peers do not finish within ``GRACE_S`` (they wait in a collective), takes the pool
down: it restarts for the next case. A case past its timeout kills the pool and raises ``subprocess.TimeoutExpired``.
A case after which a rank holds more than ``MAX_THREADS`` OS threads also stops the pool (it restarts for the next
case): a run whose objects outlive it keeps its process groups' gloo threads, and a thousand such threads slow every
later case and fresh launch on a 2-core machine. The one such leak known, megatron-core 0.16.1's MoE layers, is
mended by the rank itself (``pool_worker.empty_leaked_modules``; docs/testing.md); the limit guards against others.

The pools start when first asked for and stop at the end of the session (``shutdown``, from conftest.py).
``OMNIBAL_TEST_POOLS=0`` runs every case in fresh processes instead (``fresh_run``), to tell a pool problem from a
trainer one. What still needs fresh processes (torchrun's restarts, ``OMNIBAL_FAULT``, timeouts, a command's own
exit path) calls ``benchlib`` directly.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402

SIZES = (1, 2, 4)  # the pools' world sizes
START_TIMEOUT_S = 600  # a rank's imports and rendezvous (minutes on a loaded machine)
GRACE_S = 10  # how long the other ranks of a failed case may take to finish before the pool is taken down
POLL_S = 0.02
MAX_THREADS = 300  # OS threads a rank may hold after a case before the pool is restarted (a fresh rank: 4 to 9)


@dataclass(frozen=True)
class CaseRun:
    """One case: the first nonzero exit status of its ranks (or 0; a rank that died comes first: the others fail in
    its wake), their standard output and error (each in rank order), its wall time (s) and whether it ran in a
    pool."""

    returncode: int
    stdout: list[str]
    stderr: list[str]
    wall_s: float
    pooled: bool

    @property
    def output(self) -> str:
        """Each rank's output then its errors, in rank order (what a launch's merged log holds, line order aside)."""
        return "".join(o + e for o, e in zip(self.stdout, self.stderr))


class PoolDown(RuntimeError):
    """A rank of the pool died (or had to be killed) during a case."""


class ForkedRank:
    """A rank forked by the session's ``Zygote``, with the part of ``subprocess.Popen``'s interface the pool uses:
    ``pid``, ``stdin`` (the write end of its cases' named pipe), ``poll``, ``wait``, ``kill``, ``returncode``."""

    def __init__(self, pid: int, cases: Path, exit_file: Path, zygote: "Zygote"):
        self.pid, self.exit_file, self.zygote = pid, exit_file, zygote
        self.returncode: int | None = None
        self.stdin = self._open_cases(cases)

    def _open_cases(self, cases: Path):
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the rank opens its end first; until then a non-blocking open finds no reader (ENXIO)
            try:
                fd = os.open(cases, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:
                if e.errno != errno.ENXIO or self.poll() is not None or time.monotonic() > deadline:
                    raise PoolDown(f"rank {self.pid} never read its cases ({e}; exit status {self.returncode})")
                time.sleep(POLL_S / 4)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "w")

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.exit_file.exists():
                self.returncode = int(self.exit_file.read_text())
            elif not self.zygote.alive and not _exists(self.pid):  # nobody left to write its status
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pool rank {self.pid}", timeout)
            time.sleep(POLL_S)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Zygote:
    """The session's rank maker (``pool_worker.zygote``): a process that imported what a rank imports once, and forks
    a rank on request in milliseconds. Without it every rank of every pool start and restart paid the 6-7 s of those
    imports (22 rank starts in a run of the suite on two pytest-xdist workers)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.proc: subprocess.Popen | None = None
        self.spawned = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, env: dict, cwd: Path, log: Path, pool_dir: Path) -> ForkedRank:
        """A rank with environment ``env`` (the whole of it), working directory ``cwd``, its output in ``log``, serving
        the pool in ``pool_dir``."""
        if not self.alive:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / "zygote.log", "a") as out:
                self.proc = subprocess.Popen([sys.executable, "-u", str(TESTS / "pool_worker.py"), "zygote"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, text=True,
                                             cwd=self.folder, env=benchlib.trainer_env())
        name = f"rank{self.spawned}"
        self.spawned += 1
        cases, exit_file = self.folder / f"{name}.cases", self.folder / f"{name}.exit"
        os.mkfifo(cases)
        request = {"env": env, "cwd": str(cwd), "log": str(log), "cases": str(cases), "pool_dir": str(pool_dir),
                   "exit": str(exit_file)}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
        except (OSError, ValueError):
            raise PoolDown(f"the pools' zygote failed:\n{(self.folder / 'zygote.log').read_text()[-4000:]}") from None
        return ForkedRank(pid, cases, exit_file, self)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class WorkerPool:
    """``nproc`` ranks of ``pool_worker.py`` in one gloo world, serving cases one at a time."""

    def __init__(self, nproc: int, folder: Path, threads: int = 1):
        self.nproc = nproc
        self.folder = Path(folder)
        self.threads = threads
        self.procs: list[ForkedRank] = []
        self.cases = 0  # cases run (ids of the case files)
        self.starts = 0  # how many times the ranks were started
        self.most_threads = 0  # the most OS threads a rank held after a case

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start(self) -> None:
        self.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        for ready in self.folder.glob("ready.rank*"):
            ready.unlink()
        env = benchlib.trainer_env(self.threads)
        port = str(benchlib.free_port())
        self.procs = [_zygote().spawn({**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(self.nproc),
                                       "LOCAL_WORLD_SIZE": str(self.nproc), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": port},
                                      self.folder, self.folder / f"worker{self.starts}.rank{r}.log", self.folder)
                      for r in range(self.nproc)]
        self.starts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all((self.folder / f"ready.rank{r}").exists() for r in range(self.nproc)):
            if not self.alive or time.monotonic() > deadline:
                log = self._worker_logs()
                self.stop()
                raise PoolDown(f"pool of {self.nproc} failed to start:\n{log[-4000:]}")
            time.sleep(POLL_S * 5)

    def stop(self) -> None:
        """Close the ranks' input (they leave their loop and the world), kill those still there after 10 s."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self.stop()

    def run(self, target: str, argv: list[str], cwd: str | os.PathLike, env: dict | None = None,
            timeout: float = 600) -> CaseRun:
        """``target`` (``module:function``) called on ``argv`` in every rank, in ``cwd`` with ``env`` added to the
        environment (``PYTHONPATH`` also extends ``sys.path``)."""
        if not self.alive:
            self.start()
        case_id = self.cases
        self.cases += 1
        case = {"id": case_id, "target": target, "argv": [str(a) for a in argv], "cwd": str(cwd),
                "env": {k: str(v) for k, v in (env or {}).items()}}
        t0 = time.perf_counter()
        line = json.dumps(case) + "\n"
        for p in self.procs:
            p.stdin.write(line)
            p.stdin.flush()
        done = [self.folder / f"case{case_id}.rank{r}.json" for r in range(self.nproc)]
        deadline, failed_at, codes, threads = time.monotonic() + timeout, None, {}, {}
        while len(codes) < self.nproc:
            for r, f in enumerate(done):
                if r not in codes and f.exists():
                    done_r = json.loads(f.read_text())
                    codes[r] = done_r["returncode"]
                    threads[r] = done_r["threads"]
            if len(codes) == self.nproc:
                break
            if failed_at is None and any(codes.values()):
                failed_at = time.monotonic()
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead or (failed_at is not None and time.monotonic() - failed_at > GRACE_S):
                out, err = self._output(case_id)
                died = {r: self.procs[r].returncode for r in dead}
                why = f"rank(s) {sorted(died)} died ({died})" if died else "the other ranks did not finish"
                err[-1] += f"{self._worker_logs()}\n[pool of {self.nproc}: {why}; it restarts for the next case]\n"
                self.kill()
                # a rank's death is the cause (the others fail in its wake, at a time that varies): its status first
                code = next((c for c in died.values() if c), 0) or next((c for c in codes.values() if c), 1)
                return CaseRun(code, out, err, time.perf_counter() - t0, True)
            if time.monotonic() > deadline:
                out, err = self._output(case_id)
                self.kill()
                raise subprocess.TimeoutExpired(f"{target} {' '.join(case['argv'])}", timeout, "".join(out),
                                                "".join(err))
            time.sleep(POLL_S)
        code = next((codes[r] for r in range(self.nproc) if codes[r]), 0)
        result = CaseRun(code, *self._output(case_id), time.perf_counter() - t0, True)
        self.most_threads = max(self.most_threads, *threads.values())
        if max(threads.values()) > MAX_THREADS:  # leaked groups' gloo threads (module docstring)
            self.stop()
        return result

    def _output(self, case_id: int) -> tuple[list[str], list[str]]:
        """(standard output, standard error) of each rank in case ``case_id``."""
        def read(f: Path) -> str:
            return f.read_text(errors="replace") if f.exists() else ""

        return ([read(self.folder / f"case{case_id}.rank{r}.out") for r in range(self.nproc)],
                [read(self.folder / f"case{case_id}.rank{r}.err") for r in range(self.nproc)])

    def _worker_logs(self) -> str:
        logs = sorted(self.folder.glob(f"worker{self.starts - 1}.rank*.log"))
        return "".join(f.read_text(errors="replace") for f in logs)


_POOLS: dict[int, WorkerPool] = {}
_FOLDER: list[Path] = []
_ZYGOTE: list[Zygote] = []


def enabled() -> bool:
    """Whether cases run in pools (``OMNIBAL_TEST_POOLS=0``: each in fresh processes)."""
    return os.environ.get("OMNIBAL_TEST_POOLS", "1") != "0"


def _folder() -> Path:
    if not _FOLDER:
        _FOLDER.append(Path(tempfile.mkdtemp(prefix="omnibal-pools-")))
    return _FOLDER[0]


def _zygote() -> Zygote:
    """The session's rank maker (started with the first rank)."""
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote(_folder() / "zygote"))
    return _ZYGOTE[0]


def pool(nproc: int) -> WorkerPool:
    """The session's pool of ``nproc`` ranks (started by its first case)."""
    if nproc not in SIZES:
        raise ValueError(f"no pool of {nproc} ranks (pools: {SIZES})")
    if nproc not in _POOLS:
        _POOLS[nproc] = WorkerPool(nproc, _folder() / f"pool{nproc}")
    return _POOLS[nproc]


def fresh_run(target: str, argv: list[str], nproc: int, cwd: str | os.PathLike, env: dict | None = None,
              timeout: float = 600) -> CaseRun:
    """The same case in ``nproc`` fresh processes, each calling ``target`` (``pool_worker.py call``): one process
    (its output and errors apart), or ``benchlib.launch_ranks`` (the environment torchrun gives; the ranks' output
    and errors merged, under stdout)."""
    t0 = time.perf_counter()
    cmd = [str(TESTS / "pool_worker.py"), "call", target, *map(str, argv)]
    env = {**benchlib.trainer_env(), **(env or {})}
    if nproc == 1:
        proc = subprocess.run([sys.executable, *cmd], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        return CaseRun(proc.returncode, [proc.stdout], [proc.stderr], time.perf_counter() - t0, False)
    code, out = benchlib.launch_ranks(cmd, nproc, Path(cwd), env, timeout)
    return CaseRun(code, [out], [""], time.perf_counter() - t0, False)


def run_case(target: str, argv: list[str], nproc: int, cwd: str | os.PathLike, env: dict | None = None,
             timeout: float = 600) -> CaseRun:
    """``target`` on ``argv`` in ``nproc`` ranks: in the pool of that size, or fresh (``enabled``)."""
    if not enabled():
        return fresh_run(target, argv, nproc, cwd, env, timeout)
    return pool(nproc).run(target, argv, cwd, env, timeout)


def stats() -> dict[int, tuple[int, int, int]]:
    """{world size: (starts, cases, the most OS threads a rank held after a case)} of the session's pools."""
    return {n: (p.starts, p.cases, p.most_threads) for n, p in sorted(_POOLS.items())}


def live_pids() -> list[int]:
    """The process ids of the live pool ranks and of the zygote, whose children they are (their CPU time: a rank's
    moves into the zygote's when it ends)."""
    zygote = [z.proc.pid for z in _ZYGOTE if z.alive]
    return zygote + [p.pid for w in _POOLS.values() for p in w.procs if p.poll() is None]


def shutdown() -> None:
    """Stop every pool and remove their folder."""
    for p in _POOLS.values():
        p.stop()
    _POOLS.clear()
    while _ZYGOTE:
        _ZYGOTE.pop().stop()
    while _FOLDER:
        shutil.rmtree(_FOLDER.pop(), ignore_errors=True)


atexit.register(shutdown)
