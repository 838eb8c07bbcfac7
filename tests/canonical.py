"""Canonical reference runs: the trainer runs that many test files compare against, launched once per session.

``TINY`` and ``TINY_MOE`` are the flag lists of the built-in model's reference runs (the files' ``BASE`` lists, which
differed only in their iteration count): a file adds ``--train-iters N`` and its data flags. ``CanonicalRuns`` serves
the iteration records of any run from the session's cache (``tests/conftest.py``: the ``serial_run`` and
``canonical_runs`` fixtures):

* its key (``RunKey``) ignores the order of the flags and the flags that cannot change an iteration record's numbers
  (``NEUTRAL``, each with its reason);
* a run of fewer iterations is served as the prefix of a longer run of the same key when the learning-rate schedule
  makes them provably the same (``Schedule``): the LR scheduler's warm-up is ``min(--lr-warmup-iters, train iters -
  1)`` iterations and ``--lr-decay-style constant`` keeps the rate flat after it, so two runs with the same warm-up
  and a constant rate take the same steps (the weight decay's schedule is always constant; nothing else reads
  ``--train-iters``, see ``megatron/training/training.py``). ``--exit-interval`` stops a run early without changing
  its steps. A run of the shared lists (``TINY`` and what extends it) asked for with fewer than ``CANONICAL_ITERS``
  iterations is launched at that length where the schedule allows it, so that every shorter run of its key is its
  prefix (their files ask for 3 to 8 iterations); any other run is launched at its own length.

``tests/test_pool.py`` checks both rules against fresh runs.
"""
from __future__ import annotations

from dataclasses import dataclass

TINY = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "0", "--lr", "2e-3",
        "--log-interval", "1", "--seed", "7", "--eval-interval", "0"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--moe-layer-freq", "[1,0,1,1]",
       "--moe-aux-loss-coeff", "0.01"]
TINY_MOE = TINY + MOE

CANONICAL_ITERS = 8  # the length a shorter request is launched at (where its schedule allows)

# flag -> (how many values it takes, why it cannot change the numbers of an iteration record)
NEUTRAL = {
    "--json-log": (1, "where the records are written (the registry names each run's own log)"),
    "--data-cache-dir": (1, "where the built-in digits dataset is kept: it is generated from fixed seeds, the same "
                            "samples in any folder"),
    "--save": (1, "a checkpoint written after a step; the run that writes it never reads it back"),
    "--save-interval": (1, "when that checkpoint is written"),
    "--log-activation-memory": (0, "saved-tensor hooks that count the bytes autograd saves and hand every tensor back "
                                   "unchanged (megatron/training/memory.py: ActivationMeter); adds a memory record, "
                                   "no iteration record"),
    "--tensorboard-dir": (1, "a copy of the log lines"),
    "--log-expert-load": (1, "the routed tokens' counts, written to a file after each step"),
}
LENGTH_FLAGS = ("--train-iters", "--exit-interval")  # in the key through Schedule and the run's length


def parse_flags(flags: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``flags`` as (flag, values) pairs in order: ``--flag=value`` split, a flag's values the tokens up to the next
    ``--`` token."""
    out: list[tuple[str, list[str]]] = []
    for token in map(str, flags):
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            out.append((name, [value] if eq else []))
        elif not out:
            raise ValueError(f"trainer flags must start with a --flag, not {token!r}")
        else:
            out[-1][1].append(token)
    return [(name, tuple(values)) for name, values in out]


def flag_value(pairs, name: str, default: str) -> str:
    """The last value given to flag ``name`` (the parser keeps the last), or ``default``."""
    values = [v for n, v in pairs if n == name]
    return values[-1][0] if values else default


@dataclass(frozen=True)
class Schedule:
    """What of ``--train-iters`` the numbers of a run's iterations depend on: with a constant learning rate after
    the warm-up, only the warm-up's length (``warmup``; ``train_iters`` None); otherwise the whole schedule
    (``train_iters``)."""

    warmup: int
    train_iters: int | None

    @classmethod
    def of(cls, pairs, train_iters: int | None = None) -> "Schedule":
        """The schedule of the flags ``pairs`` (``parse_flags``), trained for ``train_iters`` (default: theirs)."""
        train = train_iters or int(flag_value(pairs, "--train-iters", "1500"))
        warmup = min(int(flag_value(pairs, "--lr-warmup-iters", "10")), max(train - 1, 0))
        constant = flag_value(pairs, "--lr-decay-style", "constant") == "constant"
        return cls(warmup, None if constant else train)


@dataclass(frozen=True)
class RunKey:
    """A run as far as its iteration records' numbers go: world size, the flags but the neutral and length ones
    (sorted by flag; a repeated flag keeps its order), the schedule; and its length apart."""

    nproc: int
    flags: tuple[tuple[str, tuple[str, ...]], ...]
    schedule: Schedule
    iters: int

    @classmethod
    def of(cls, nproc: int, flags: list[str]) -> "RunKey":
        pairs = parse_flags(flags)
        kept = [(n, v) for n, v in pairs if n not in NEUTRAL and n not in LENGTH_FLAGS]
        bad = [n for n, v in pairs if n in NEUTRAL and len(v) != NEUTRAL[n][0]]
        if bad:
            raise ValueError(f"flags {bad}: not the number of values canonical.NEUTRAL says")
        train = int(flag_value(pairs, "--train-iters", "1500"))
        exit_at = int(flag_value(pairs, "--exit-interval", "0"))
        iters = min(exit_at, train) if exit_at else train
        return cls(nproc, tuple(sorted(kept, key=lambda p: p[0])), Schedule.of(pairs), iters)

    def same_steps(self, other: "RunKey") -> bool:
        """Whether the first iterations of ``self`` and ``other`` are provably the same steps."""
        return (self.nproc, self.flags, self.schedule) == (other.nproc, other.flags, other.schedule)


WRITES = ("--json-log", "--save", "--save-interval")  # neutral flags whose files a records-only request does not read


def with_length(flags: list[str], iters: int) -> list[str]:
    """``flags`` training ``iters`` iterations: ``--train-iters iters``, no ``--exit-interval``, nothing written but
    the log (``WRITES``)."""
    pairs = [(n, v) for n, v in parse_flags(flags) if n not in WRITES and n not in LENGTH_FLAGS]
    return [t for n, v in pairs for t in (n, *v)] + ["--train-iters", str(iters)]


class CanonicalRuns:
    """The iteration records of trainer runs, each launched once per session (through ``SharedRuns``, so that a
    test asking for the same flags with its output shares the launch too)."""

    def __init__(self, shared):
        self.shared = shared  # conftest.SharedRuns
        self._runs: list[tuple[RunKey, list[dict]]] = []

    def records(self, nproc: int, flags: list[str]) -> list[dict]:
        """The iteration records (copies) of ``flags`` on ``nproc`` ranks: from a run of the session with the same
        key and at least as many iterations, else from a new run (of ``CANONICAL_ITERS`` iterations where the
        schedule allows). Prefixes are served only to runs logging every iteration (``--log-interval 1``)."""
        key, pairs = RunKey.of(nproc, flags), parse_flags(flags)
        every = flag_value(pairs, "--log-interval", "1") == "1"
        for have, records in self._runs:
            if have.same_steps(key) and (have.iters == key.iters or (every and have.iters > key.iters)):
                return [dict(r) for r in records if r["iteration"] <= key.iters]
        longer = (every and key.iters < CANONICAL_ITERS and Schedule.of(pairs, CANONICAL_ITERS) == key.schedule
                  and set(parse_flags(TINY)) <= set(pairs))  # one of the shared lists: their requests vary in length
        iters = CANONICAL_ITERS if longer else key.iters
        records = self.shared.run(nproc, with_length(flags, iters))[0]
        self._runs.append((RunKey.of(nproc, with_length(flags, iters)), records))
        return [dict(r) for r in records if r["iteration"] <= key.iters]

    @property
    def launched(self) -> list[RunKey]:
        return [k for k, _ in self._runs]
