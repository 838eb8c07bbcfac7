"""The project's own error classes: mistakes in a user's flags, files or data.

``pretrain_vlm.py`` and ``omnibal`` turn exactly these into one line on stderr and exit status 1, as Megatron-LM's
refusals exit: a mistake in the flags or inputs, or a :class:`RunStopped` (the run stopped itself to protect its work:
a NaN, a checkpoint folder held by another run, a full disk). Every other exception is a bug (ours or a library's) and
keeps its traceback (Python's status, also 1: the traceback tells the two apart). A command line argparse cannot
parse (an unknown flag, a missing value) keeps argparse's status 2. Subclasses derive from ``ValueError`` too, so
callers that caught ``ValueError`` before keep working.
"""
from __future__ import annotations

import sys


class UserError(ValueError):
    """A user's mistake, described in one paragraph that names the flag, file, record or tensor."""

    exit_status = 1  # fix the command line or the inputs and run again


class RunStopped(UserError):
    """A run that stopped itself before it lost work (non-finite loss or gradients, a ``--save`` folder that
    another run holds, no space left for a checkpoint); the message names the iteration, folder or flag."""

    exit_status = 1


def one_line(error: BaseException) -> str:
    """The error's message on one line (one line per process on stderr): its lines joined by "; ",
    or by a space after a line ending in ":" (a heading such as "3 problem(s) in the data of m.json:")."""
    out = ""
    for line in (" ".join(part.split()) for part in str(error).splitlines()):
        if line:
            out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def report(error: UserError, prefix: str = "") -> int:
    """Print ``{prefix}error: message`` as one line on stderr; returns the error's exit status (1)."""

    message = one_line(error)
    if prefix and message.startswith(prefix):
        message = message[len(prefix):]
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    return error.exit_status
