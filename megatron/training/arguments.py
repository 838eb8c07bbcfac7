"""The command line of a run: the flags parsed (``flags.py``), checked (``validation.py``) and turned into the
typed :class:`~megatron.training.config.RunConfig` (``specs.py``), once, before any process group, model or data
is built.  Nothing below ``pretrain_vlm.main`` reads the parsed flags.
"""
from __future__ import annotations

import argparse
import json
import sys

from omnibal_ext.plan import trainer_argv

from megatron.vlm.families import import_family_modules as import_modules

from .config import RunConfig
from .flags import ArgumentError, build_parser
from .specs import run_config
from .validation import validate_flags


def plan_flags(path: str) -> list[str]:
    """The trainer flags of a plan written by `omnibal plan` (its "trainer_flags")."""
    try:
        with open(path) as f:
            flags = json.load(f)["trainer_flags"]
    except FileNotFoundError:
        raise ArgumentError(f"--omnibal-plan {path}: no such file") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ArgumentError(f"--omnibal-plan {path}: not a plan from `omnibal plan` ({e})") from None
    return trainer_argv(flags)


def import_family_modules(argv: list[str]) -> None:
    """Import the ``--family-module`` modules of ``argv`` (before the parser is built: their presets are
    ``--model`` choices). Each registers its family (``omnibal_ext.model.families.register``)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--family-module", action="append", default=[])
    modules = pre.parse_known_args(argv)[0].family_module
    if modules:
        import_modules(modules)


def requested_device(argv=None) -> str:
    """The --device of ``argv`` (default: sys.argv[1:]) before the full parse and checks: the CPU
    patches (cpu_compat) must be in place before any process group starts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    import_family_modules(argv)
    known, _ = build_parser().parse_known_args(argv)
    return known.device


def parse_flags(argv=None, world_size: int = 1) -> argparse.Namespace:
    """The flags of ``argv`` (default: sys.argv[1:]) parsed and checked for ``world_size`` processes.  With
    --omnibal-plan, the plan's flags come first, so flags given on the command line override them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    import_family_modules(argv)
    parser = build_parser()
    flags = parser.parse_args(argv)
    if flags.omnibal_plan:
        flags = parser.parse_args(plan_flags(flags.omnibal_plan) + argv)
    validate_flags(flags, world_size)
    return flags


def parse_config(argv=None, world_size: int = 1) -> RunConfig:
    """The run's typed configuration of the command line ``argv`` (see :func:`parse_flags`)."""
    return run_config(parse_flags(argv, world_size), world_size)
