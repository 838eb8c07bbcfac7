"""Shared modules name no model family: the trainer (``megatron/training``), the runtime outside
``megatron/vlm/families/``, the planners outside ``omnibal_ext/model/families/`` and the entry points hold no
family's name, in code or docstrings, so a family is added without editing them. Text decoders (Llama, Qwen2,
InternLM2: the LLMs every family may use, ``megatron.vlm.hf.text_configs``) are no model families."""
from __future__ import annotations

import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ("megatron/training", "megatron/vlm", "omnibal_ext", "pretrain_vlm.py", "omnibal_cli.py", "setup.py")
FAMILY_FOLDERS = ("megatron/vlm/families", "omnibal_ext/model/families")
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
