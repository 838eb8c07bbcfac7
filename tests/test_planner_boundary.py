"""The planner path's boundary: in a subprocess where ``torch``, ``megatron.core`` and ``transformers`` cannot be
imported (a meta path finder raising ImportError for them), every module of ``omnibal_ext`` but the profiler, the
families' registry package, every family package's tensor-free modules (``__init__``, ``kinds``, ``costs``,
``presets``), the lineage library's kinds and cost modules and the GPT decoder's kinds import (each kind names its
run-time parts without importing them), and ``omnibal plan`` runs on EVERY registered preset (exit 0, a plan JSON
naming the preset). The same check fails when a planner module imports torch: shown with a module that does, put on
the path of a second subprocess. And ``omnibal_ext`` imports nothing of ``megatron`` (read from its imports)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "transformers", "megatron.core")

BLOCKER = textwrap.dedent(f"""
    import sys

    class Blocked:
        '''Refuses the packages the planner path must not import.'''
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in {BLOCKED!r}):
                raise ImportError(f"blocked on the planner path: {{name}}")
            return None

    sys.meta_path.insert(0, Blocked())
    sys.path.insert(0, {str(ROOT)!r})
""")

TORCH_FREE = textwrap.dedent("""
    import importlib, pkgutil
    import omnibal_ext
    skipped = {"omnibal_ext.model.profile"}  # the profiler: the one module that runs tensors
    for m in pkgutil.walk_packages(omnibal_ext.__path__, "omnibal_ext."):
        if m.name not in skipped:
            importlib.import_module(m.name)
    import megatron.vlm.families as families
    for name in families.FAMILIES:
        folder = name.replace("-", "_")
        for module in ("kinds", "costs", "presets"):
            importlib.import_module(f"megatron.vlm.families.{folder}.{module}")
    for module in ("megatron.vlm.lineages.qwen.kinds", "megatron.vlm.lineages.qwen.vision_costs",
                   "megatron.vlm.stage.kinds"):
        importlib.import_module(module)
    outside = sorted(n for n, mod in sys.modules.items()
                     if n.startswith(("megatron.", "omnibal_ext")) and getattr(mod, "__file__", None)
                     and not mod.__file__.startswith(ROOT))
    assert not outside, f"modules imported from outside the checkout: {outside}"
""")


def run_blocked(code: str, cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    script = BLOCKER + f"ROOT = {str(ROOT)!r}\n" + code
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1200)


def native_stats(path: Path) -> None:
    """A small stats file whose images carry sizes and patch counts (native-resolution families plan from them;
    tiled ones from the tile counts): written without torch, by the planners' own stats writer."""
    import numpy as np

    from omnibal_ext.data.native import derive_native_stats, records_of
    from omnibal_ext.data.stats import from_arrays

    rng = np.random.default_rng(3)
    tiles = rng.choice([1, 3, 5], 300)
    stats = derive_native_stats(from_arrays(tiles, 256 * tiles + rng.integers(50, 600, 300)), max_num=6, patch=14,
                                min_pixels=3136, max_pixels=1003520)
    path.write_text(json.dumps(records_of(stats)))


PLAN_EVERY_PRESET = textwrap.dedent("""
    import contextlib, io, json
    from omnibal_cli import main
    from omnibal_ext.model.units import PRESETS
    assert len(PRESETS) >= 30, sorted(PRESETS)
    failed = {}
    for name in PRESETS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = main(["plan", "--data", "native.json", "--model", name, "--gpus", "4", "--gpu-memory", "100000",
                       "--tp", "1", "--pp", "2", "--global-batch-size", "64", "--sim-iterations", "1",
                       "--samples", "1000", "--json", "plan.json"])
        if rc != 0 or json.load(open("plan.json"))["model"] != name:
            failed[name] = out.getvalue()[-400:]
    assert not failed, failed
    assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") or m.startswith("megatron.core")]
    print("planned", len(PRESETS))
""")


@pytest.mark.slow  # one subprocess, ~35 presets planned (about a minute)
def test_omnibal_plan_runs_on_every_preset_without_torch(tmp_path):
    native_stats(tmp_path / "native.json")
    proc = run_blocked(TORCH_FREE + PLAN_EVERY_PRESET, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "planned" in proc.stdout


def test_the_tensor_free_modules_import_without_torch(tmp_path):
    proc = run_blocked(TORCH_FREE + "print('ok')\n", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")


def test_the_boundary_fails_when_a_planner_module_imports_torch(tmp_path):
    """A planner-side module that imports torch (here a stand-in put first on the path) fails the same check."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "bad_planner.py").write_text("import torch  # a planner module must not\n")
    proc = run_blocked("import bad_planner\n", tmp_path, extra_path=bad)
    assert proc.returncode != 0
    assert "blocked on the planner path: torch" in proc.stderr


def test_omnibal_ext_imports_nothing_of_megatron():
    found = []
    for path in sorted((ROOT / "omnibal_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "megatron"]
    assert not found, found
