"""The warnings that megatron-core and Energon raise on every CPU launch, none of them about our use, silenced by
the entry points (``pretrain_vlm.py``, ``omnibal_cli.py``) before they import megatron-core, which warns as it loads.
Anything else still shows."""
from __future__ import annotations

import warnings

KNOWN = (
    ".*Transformer Engine and Apex are not installed.*",  # megatron-core falls back to torch's kernels (CPU setup)
    ".*Apex is not installed.*",
    ".*full scope is deprecated.*",  # megatron-core's own TransformerConfig default
    ".*'pin_memory' argument is set as true but no accelerator.*",  # Energon's loader on a CPU-only machine
)


def silence() -> None:
    """Ignore the :data:`KNOWN` warnings in this process."""
    for message in KNOWN:
        warnings.filterwarnings("ignore", message=message)
