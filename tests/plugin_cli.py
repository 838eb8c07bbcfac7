"""``omnibal`` with plugin families imported first, as a worker-pool case (``plugin_cli:main``):

    [--family-module MODULE ...] OMNIBAL_ARGS...

`omnibal hf import|export` takes no ``--family-module`` (the trainer does); the conformance suite converts a plugin
family's folders through this. Without ``--family-module`` it is ``omnibal_cli.main``.
"""
from __future__ import annotations


def main(argv: list[str]) -> int:
    import omnibal_cli
    from megatron.vlm.families import import_family_modules

    rest, modules = list(argv), []
    while rest[:1] == ["--family-module"]:
        modules.append(rest[1])
        rest = rest[2:]
    import_family_modules(modules)
    return omnibal_cli.main(rest)
