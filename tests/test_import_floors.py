"""The runtime's floors, read from the imports (AST, every import, inside functions too): a module of ``megatron/``
imports only modules on its own floor or below, so nothing runs back up:

    parallel  <  layers  <  data (and the low Hugging Face modules)  <  stage  <  hf  <  lineages  <  families  <  training
    (and inference, generation, beside it)

(``omnibal_ext`` sits under all of them and imports none.) Every ``megatron.vlm`` / ``megatron.training`` module an
import names exists in this checkout (the installed editable copy of the main checkout shares the ``megatron``
namespace, where a stale name would still import). The floor reader is shown to catch a module that imports upward.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (module prefix, floor); the longest prefix that matches a module gives its floor
FLOORS = [
    ("megatron.vlm.parallel", 0),
    ("megatron.vlm.layers", 1),
    ("megatron.vlm.data", 2),
    ("megatron.vlm.hf.config", 2),  # the HF side's types and readers of config keys, below the stage
    ("megatron.vlm.hf.recipes", 2),
    ("megatron.vlm.hf.text_configs", 2),
    ("megatron.vlm.hf.reader", 2),
    ("megatron.vlm.stage", 3),
    ("megatron.vlm.hf", 4),  # conversion, loading into stages, logits
    ("megatron.vlm.lineages", 5),
    ("megatron.vlm.families", 6),
    ("megatron.training", 7),
    ("megatron.vlm.inference", 7),  # generation builds its model as the trainer does; --eval-generate runs it
]
NAMES = dict(FLOORS)


def floor_of(module: str) -> int | None:
    """The floor of ``module`` (None: outside the floors: omnibal_ext, megatron.core, the standard library ...)."""
    best = None
    for prefix, floor in FLOORS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, floor)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in ``path`` (``from X import y``: X and X.y, relative ones resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def upward_imports(path: Path) -> list[str]:
    here = floor_of(module_name(path))
    if here is None:
        return []
    return [f"{path.relative_to(ROOT)}:{line}: imports {target} (floor {floor_of(target)} > {here})"
            for line, target in imports_of(path) if (floor_of(target) or -1) > here]


def runtime_files() -> list[Path]:
    return sorted(p for p in (ROOT / "megatron").rglob("*.py"))


def test_no_import_runs_back_up():
    files = runtime_files()
    assert len(files) > 80
    assert all(floor_of(module_name(f)) is not None for f in files), [f for f in files if floor_of(module_name(f)) is None]
    found = [line for f in files for line in upward_imports(f)]
    assert not found, "imports running back up a floor:\n" + "\n".join(found)


def test_the_floor_reader_catches_an_upward_import():
    probe = ROOT / "megatron/vlm/layers/_probe_upward.py"
    try:
        probe.write_text("def f():\n    from megatron.vlm.stage.components import RuntimeComponent\n"
                         "from ..parallel import sequence_parallel\n")
        found = upward_imports(probe)
        assert len(found) == 2 and all("megatron.vlm.stage.components" in f for f in found), found
    finally:
        probe.unlink()


def test_every_imported_runtime_module_exists_here():
    """An import of ``megatron.vlm.X`` / ``megatron.training.X`` names a module, a package or a name defined in one
    in this checkout (not in the installed main checkout that shares the namespace)."""
    missing = []
    for path in runtime_files() + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py")) \
            + [ROOT / "pretrain_vlm.py", ROOT / "omnibal_cli.py"]:
        for line, target in imports_of(path):
            if not target.startswith(("megatron.vlm.", "megatron.training.")) and target not in (
                    "megatron.vlm", "megatron.training"):
                continue
            parts = target.split(".")
            # the longest prefix that is a module or package here; the rest must be one name defined in it
            for k in range(len(parts), 1, -1):
                base = ROOT.joinpath(*parts[:k])
                if base.with_suffix(".py").is_file() or base.is_dir():
                    if len(parts) - k > 1:
                        missing.append(f"{path.relative_to(ROOT)}:{line}: {target}")
                    break
            else:
                missing.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert not missing, "imports of runtime modules that this checkout lacks:\n" + "\n".join(missing)
