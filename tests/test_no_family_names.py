"""Shared modules name no model family: the trainer (``megatron/training``), the runtime outside the family folders
(``megatron/vlm/families/<name>/``) and the lineage library (``megatron/vlm/lineages/``: code a lineage of families
shares), the planners (``omnibal_ext``) and the entry points hold no family's name, in code or docstrings, so a
family is added without editing them. Text decoders (Llama, Qwen2, InternLM2: the LLMs every family may use,
``megatron.vlm.hf.text_configs``) are no model families. And no family folder imports another family's."""
from __future__ import annotations

import ast
import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ("megatron/training", "megatron/vlm", "omnibal_ext", "pretrain_vlm.py", "omnibal_cli.py", "setup.py")
FAMILY_FOLDERS = ("megatron/vlm/families", "megatron/vlm/lineages")
FAMILY_WORDS = ("internvl", "internvit", r"qwen\d*vl")  # names in prose ("InternVL", "Qwen2.5-VL", "Qwen3-VL")


def family_names() -> list[str]:
    """The built-in families (the subpackages of megatron/vlm/families) and the words they go by, written without
    separators (``qwen2_5_vl`` and "Qwen2.5-VL" are both ``qwen25vl``)."""
    built_in = [m.name for m in pkgutil.iter_modules([str(ROOT / FAMILY_FOLDERS[0])]) if m.ispkg]
    assert {"internvl", "qwen2_5_vl"} <= set(built_in), built_in
    return sorted({*FAMILY_WORDS, *(re.escape(squash(n)) for n in built_in)})


def squash(text: str) -> str:
    return re.sub(r"[-_. ]", "", text.lower())


def shared_files() -> list[Path]:
    files = []
    for entry in SHARED:
        path = ROOT / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [f for f in files if not any(f.is_relative_to(ROOT / d) for d in FAMILY_FOLDERS)]


def test_grep_finds_no_family_name_in_shared_modules():
    pattern = re.compile("|".join(family_names()))
    files = shared_files()
    assert len(files) > 100 and ROOT / "megatron/training/arguments.py" in files
    found = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files
             for n, line in enumerate(f.read_text().splitlines(), start=1) if pattern.search(squash(line))]
    assert not found, "family names in shared modules:\n" + "\n".join(found)


def test_the_grep_catches_each_way_of_writing_a_family():
    pattern = re.compile("|".join(family_names()))
    for text in ("InternVL's tiles", "Qwen2.5-VL patches", "qwen2_5_vl", "Qwen3-VL", "QWEN2-VL", "InternViT-6B"):
        assert pattern.search(squash(text)), text
    for text in ("a Qwen2 decoder", "llama", "internlm2", "the ViT's layers"):
        assert not pattern.search(squash(text)), text


def family_imports(path: Path) -> set[str]:
    """The built-in families whose folders ``path`` imports (absolute imports of ``megatron.vlm.families.<name>``,
    relative ones climbing out of its own folder)."""
    names = {m.name for m in pkgutil.iter_modules([str(ROOT / FAMILY_FOLDERS[0])]) if m.ispkg}
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[:3] == ["megatron", "vlm", "families"] and len(parts) > 3 and parts[3] in names:
                found.add(parts[3])
    return found


def test_no_family_folder_imports_another_family():
    folders = sorted(p for p in (ROOT / FAMILY_FOLDERS[0]).iterdir() if (p / "__init__.py").exists())
    assert len(folders) >= 4, folders
    crossing = {f"{py.relative_to(ROOT)}: {sorted(family_imports(py) - {folder.name})}"
                for folder in folders for py in folder.rglob("*.py") if family_imports(py) - {folder.name}}
    assert not crossing, "family folders importing another family:\n" + "\n".join(sorted(crossing))


def test_the_lineage_library_imports_no_family():
    files = sorted((ROOT / FAMILY_FOLDERS[1]).rglob("*.py"))
    assert files
    found = {f"{f.relative_to(ROOT)}: {sorted(family_imports(f))}" for f in files if family_imports(f)}
    assert not found, "the lineage library imports families:\n" + "\n".join(sorted(found))


def test_the_import_reader_sees_a_crossing(tmp_path):
    """The check fails where a family's module imports another family (absolute and relative forms)."""
    folder = ROOT / FAMILY_FOLDERS[0] / "qwen3_5"
    assert family_imports(folder / "hf.py") == {"qwen3_5"}  # its own folder only (.costs)
    probe = folder / "_probe_crossing.py"
    try:
        probe.write_text("from megatron.vlm.families.qwen3_vl import hf\nfrom ..internvl.costs import VisionSpec\n")
        assert family_imports(probe) == {"qwen3_vl", "internvl"}
    finally:
        probe.unlink()
