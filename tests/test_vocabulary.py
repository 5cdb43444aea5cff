"""One word per concept (issue 53): a request's priority is called ``priority`` (vLLM's word) everywhere, never
a lane, a class or a rank, and its values are ``interactive`` and ``background``; "batch" means only what an
engine runs at once (and the OpenAI Batch API's own names). Pins it: no identifier of the code says lane or
RANK, and no document says lane or "batch class" outside the notes on the deprecated names."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "producer", "gateway", "worker")
BANNED_WORDS = {"lane", "lanes"}  # as a whole identifier or one of its snake_case words, any case
BANNED_NAMES = {"RANK"}  # the engine's int is LEVEL (common/wire/priority.py)
# other meanings of "lane" that stay: a SIMD lane (the attention kernels), "16-lane", "in 16 lanes"
OTHER_LANES = re.compile(r"SIMD lanes?|\d+[- ]lanes?", re.I)
DOC_WORDS = re.compile(r"\blanes?\b|\bbatch[- ]class(es)?\b", re.I)


def identifiers(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every name the code defines or uses: names, attributes, arguments, keywords, functions, classes,
    imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.keyword) and node.arg is not None:
            yield node.arg, node.value.lineno
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module:
            for part in node.module.split("."):
                yield part, node.lineno
        elif isinstance(node, ast.alias):
            for part in node.name.split(".") + ([node.asname] if node.asname else []):
                yield part, getattr(node, "lineno", 0)


def banned(name: str) -> bool:
    return name in BANNED_NAMES or bool(BANNED_WORDS & set(name.lower().split("_")))


@pytest.mark.unit
def test_no_identifier_says_lane_or_rank():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            found += [f"{path.relative_to(ROOT)}:{line}: {name}" for name, line in identifiers(tree) if banned(name)]
    assert not found, "the priority is called priority (PRIORITIES, priority_of, LEVEL):\n" + "\n".join(found)


@pytest.mark.unit
def test_the_check_sees_each_kind_of_identifier():
    code = "from m.lanes import LANES as L\ndef lane_of(lane): return RANK[x.lane]\nf(lane=1)\n"
    assert {n for n, _ in identifiers(ast.parse(code)) if banned(n)} == {"lanes", "LANES", "lane_of", "lane",
                                                                       "RANK"}
    assert not banned("planet") and not banned("priority") and not banned("LEVEL")


def without_deprecation_notes(path: Path, text: str) -> str:
    """The text minus the notes that name the old words on purpose: docs/CONFIGURATION.md's section
    "Deprecated names" and the paragraph of docs/OPERATIONS.md that starts "**Deprecated names.**"."""
    if path.name == "CONFIGURATION.md":
        text = re.sub(r"^## Deprecated names\n.*?(?=^## |\Z)", "", text, flags=re.S | re.M)
    if path.name == "OPERATIONS.md":
        text = re.sub(r"^\*\*Deprecated names\.\*\*.*?(?=\n\n|\Z)", "", text, flags=re.S | re.M)
    return text


@pytest.mark.unit
def test_no_document_says_lane_or_batch_class():
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    found = []
    for path in docs:
        text = without_deprecation_notes(path, path.read_text(encoding="utf-8"))
        for line in text.splitlines():
            if DOC_WORDS.search(OTHER_LANES.sub("", line)):
                found.append(f"{path.relative_to(ROOT)}: {line.strip()[:120]}")
    assert not found, "say priority (and background, not batch, for its value):\n" + "\n".join(found)
    for name in ("CONFIGURATION.md", "OPERATIONS.md"):  # the notes are there, and only they were skipped
        text = (ROOT / "docs" / name).read_text(encoding="utf-8")
        assert "Deprecated names" in text and without_deprecation_notes(Path(name), text) != text, name
