"""Import layers of the project, read from the source (every import statement counts: at the top, inside a
function, under TYPE_CHECKING): omnibal_ext imports nothing of the trainer, and no module imports itself
back through others."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ("megatron", "pretrain_vlm", "omnibal_cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, Path]:
    files = [p for top in ("omnibal_ext", "megatron") for p in (ROOT / top).rglob("*.py")]
    files += [ROOT / "pretrain_vlm.py", ROOT / "omnibal_cli.py"]
    return {_module_name(p): p for p in files}


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, names imported from it: [] for ``import module``) of every import statement of the
    module ``name`` (file ``path``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found.append((base, [a.name for a in node.names]))
    return found


def test_omnibal_ext_imports_nothing_of_the_trainer():
    offenders = [f"{name} imports {base}" for name, path in _project_modules().items() if name.startswith("omnibal_ext")
                 for base, _ in _imports(name, path) if base.split(".")[0] in TRAINER]
    assert not offenders, offenders


def test_no_import_cycles():
    modules = _project_modules()

    def resolve(imp: str) -> str | None:  # the project module ``imp`` is or is in
        while imp and imp not in modules:
            imp = imp.rpartition(".")[0]
        return imp or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for base, names in _imports(name, path):
            # ``from pkg import mod`` depends on the module pkg.mod; ``from mod import x`` on mod
            targets.update(resolve(f"{base}.{n}" if f"{base}.{n}" in modules else base) for n in names or [""])
        graph[name] = {t for t in targets if t and t != name}
    cycles, done = [], set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, stack + [node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, [" -> ".join(c) for c in cycles]
