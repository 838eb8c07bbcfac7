"""The project's own error classes: mistakes in a user's flags, files or data.

``pretrain_vlm.py`` and ``omnibal`` turn exactly these into one line on stderr and exit status 2;
every other exception is a bug (ours or a library's) and keeps its traceback. Subclasses derive
from ``ValueError`` too, so callers that caught ``ValueError`` before keep working.
"""
from __future__ import annotations


class UserError(ValueError):
    """A user's mistake, described in one paragraph that names the flag, file, record or tensor."""
