"""One owner per ``--save`` folder: a lock file created atomically (``O_EXCL``) by the run's rank 0.

``SAVE/omnibal_save.lock`` holds the holder's host, PID, start time and (on Linux) its process start time in clock
ticks, which tells a reused PID from the holder. Another run that finds it:

* refuses, naming the holder, when the holder is alive on this host;
* takes it over with a warning when the holder is dead (no such PID on this host, or another process now);
* refuses when it is held from another host (a shared filesystem: this host cannot tell whether that run is
  alive), unless ``--force-save-lock`` says it is gone;
* refuses an unreadable lock file (a run killed between creating and writing it) unless ``--force-save-lock``.

A take-over renames the old lock aside and checks that the renamed file is the one judged dead, so that of two
runs taking over one dead lock at once, one wins. The lock is released (removed, if it is still ours) when the
run ends, also on an error; a SIGKILLed run leaves it behind, dead, for the next run to take over. Readers
(``--load`` alone, ``omnibal hf export``) take none.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time

import torch.distributed as dist

from omnibal_ext.errors import RunStopped, UserError

LOCK = "omnibal_save.lock"
FORCE_FLAG = "--force-save-lock"


class SaveLockError(RunStopped):
    """The --save folder is held by another run; the message names the holder."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock: ``host`` name, ``pid``, ``started`` (local time, ISO 8601) and ``proc_start`` (the
    process's start time in clock ticks since boot, Linux's /proc/PID/stat field 22; None elsewhere)."""

    host: str
    pid: int
    started: str
    proc_start: int | None = None

    @classmethod
    def this_process(cls) -> "Holder":
        return cls(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%dT%H:%M:%S%z"), _proc_start(os.getpid()))

    def describe(self) -> str:
        return f"PID {self.pid} on host {self.host}, started {self.started}"

    def to_text(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_text(cls, text: str) -> "Holder | None":
        """The holder written in a lock file, None when the text is not one (empty, cut, or something else)."""
        try:
            fields = json.loads(text)
            return cls(str(fields["host"]), int(fields["pid"]), str(fields["started"]), fields.get("proc_start"))
        except (ValueError, KeyError, TypeError):
            return None


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)": state is field 3, starttime 22


def holder_alive(holder: Holder, host: str) -> bool | None:
    """Whether ``holder`` still runs, seen from ``host``: None when it ran on another host (cannot tell)."""
    if holder.host != host:
        return None
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    if holder.proc_start is not None:
        now = _proc_start(holder.pid)
        if now is not None and now != holder.proc_start:
            return False  # the PID was reused by another process
    return True


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _create(path: str, me: Holder) -> bool:
    """Create the lock file holding ``me`` if none exists (atomically); False when one exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            f.write(me.to_text())
            f.flush()
            os.fsync(f.fileno())
    except OSError:  # a full disk, say: leave no empty lock behind
        os.remove(path)
        raise
    return True


def _make_folder(folder: str) -> None:
    """``--save`` created if needed; a path that cannot be a writable folder is refused, naming it."""
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"--save {folder}: cannot be a folder (a file is in the way on that path)") from None
    except OSError as e:
        raise UserError(f"--save {folder}: cannot create the folder ({e.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--save {folder}: the folder is not writable by this user")


def acquire(folder: str, force: bool = False, me: Holder | None = None) -> tuple[Holder, str | None]:
    """Take the lock of ``folder`` (created if needed) for ``me`` (default: this process); returns (``me``, a
    warning when a dead or forced holder was taken over, else None). Raises SaveLockError naming the holder."""
    me = me or Holder.this_process()
    _make_folder(folder)
    path = os.path.join(folder, LOCK)
    warning = None
    for _ in range(10):  # each round either creates the lock or takes over one holder
        try:
            if _create(path, me):
                return me, warning
        except OSError as e:
            raise UserError(f"--save {folder}: cannot write the lock file {path} ({e.strerror})") from None
        text = _read(path)
        if text is None:  # released meanwhile
            continue
        holder = Holder.from_text(text)
        if holder is None:
            time.sleep(0.5)  # perhaps just created and not yet written
            if _read(path) != text:
                continue
            if not force:
                raise SaveLockError(f"--save {folder}: its lock file {path} is unreadable ({text[:40]!r}): if no run "
                                    f"uses the folder, give {FORCE_FLAG} (or remove the file)")
            why = "an unreadable lock"
        else:
            alive = holder_alive(holder, me.host)
            if alive:
                raise SaveLockError(f"--save {folder} is in use by another run ({holder.describe()}; lock file "
                                    f"{path}): two runs saving into one folder mix their checkpoints; wait for it to "
                                    "end or give another --save")
            if alive is None and not force:
                raise SaveLockError(f"--save {folder} is locked by a run on another host ({holder.describe()}; lock "
                                    f"file {path}), which cannot be checked from {me.host}: if that run has ended, "
                                    f"give {FORCE_FLAG}")
            why = (f"the lock of a run that is gone ({holder.describe()})" if alive is False else
                   f"the lock of a run on another host ({holder.describe()}), by {FORCE_FLAG}")
        if _take_over(path, text, me):
            warning = f"> warning: --save {folder}: took over {why}"
    raise SaveLockError(f"--save {folder}: could not take its lock {path} (other runs keep taking it)")


def _take_over(path: str, judged: str, me: Holder) -> bool:
    """Move the lock whose text was ``judged`` dead aside; False (and the lock put back) when the file moved was
    another (a run took the lock over meanwhile)."""
    aside = f"{path}.taken-over-by-{me.pid}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if _read(aside) != judged:
        try:
            os.link(aside, path)  # put it back unless a third run locked meanwhile
        except FileExistsError:
            pass
        os.remove(aside)
        return False
    os.remove(aside)
    return True


def release(folder: str, me: Holder) -> None:
    """Remove the lock of ``folder`` if ``me`` still holds it (a forced take-over may have replaced it)."""
    path = os.path.join(folder, LOCK)
    if Holder.from_text(_read(path) or "") == me:
        os.remove(path)


@contextlib.contextmanager
def held(folder: str | None, force: bool = False):
    """The lock of ``folder`` held by rank 0 for the ``with`` block (nothing when ``folder`` is None). Every rank
    calls it: the others learn rank 0's result before any work, so a refused lock stops every rank with the same
    line. Released at the end of the block, also on an error."""
    if folder is None:
        yield
        return
    mine, outcome = None, None
    if dist.get_rank() == 0:
        try:
            mine, warning = acquire(folder, force)
            outcome = ("ok", warning)
        except UserError as e:
            outcome = (type(e).__name__, str(e))
    shared = [outcome]
    dist.broadcast_object_list(shared, src=0)
    kind, message = shared[0]
    if kind != "ok":
        raise (SaveLockError if kind == SaveLockError.__name__ else UserError)(message)
    if message and dist.get_rank() == 0:
        print(message, flush=True)
    try:
        yield
    finally:
        if mine is not None:
            release(folder, mine)
