"""The documents: README stays short (setup, one example per user, the folder map, links to docs/) and keeps the
two setup commands byte for byte (.ci/run and tests/test_dashboard.py run the test one); docs/README.md indexes
every document; every relative link resolves; and the two maps of the tree match it: README's per role folder,
docs/ARCHITECTURE.md's per file, at the file's real path. Pure reads of the repository: unit.

The examples these documents hold run elsewhere: tests/test_readme.py (Python and command-line blocks of
README, docs/USAGE.md and docs/GATEWAY.md), tests/test_gateway.py (docs/GATEWAY.md's gateway block)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.imports import PACKAGES, ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_BYTES = 15_000  # issue 53: the README fits a few screens; the rest lives in docs/
SETUP_COMMANDS = ('python3 -m pip install -e ".[dev]" && batchfleet demo',
                  'python3 -m pip install -e ".[dev]" && python3 -m pytest -q')


@pytest.mark.unit
def test_readme_is_at_most_15_kb():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move sections to docs/ (docs/README.md lists them)"


@pytest.mark.unit
def test_readme_keeps_the_two_setup_commands():
    blocks = re.findall(r"^```bash\n(.*?)\n```", README.read_text(), flags=re.S | re.M)
    for command in SETUP_COMMANDS:
        assert command in blocks, f"README lost its setup command {command!r}"


VENV = "python3 -m venv .venv && . .venv/bin/activate"  # the prerequisite before them (docs/INSTALL.md)


@pytest.mark.unit
def test_readme_setup_is_the_venv_prerequisite_then_the_two_commands():
    """Debian's and Ubuntu's own Python refuse `pip install` outside a virtual environment: the setup section
    makes one first, as a prerequisite (not a third setup command), then keeps exactly the two commands."""
    text = README.read_text()
    section = text[text.index("## Setup on a fresh machine"):]
    section = section[:section.index("\n## ")]
    assert re.findall(r"^```bash\n(.*?)\n```", section, flags=re.S | re.M) == [VENV, *SETUP_COMMANDS]
    before = " ".join(section[:section.index(VENV)].split())
    assert "Prerequisite, not a set-up step" in before and "externally-managed-environment" in before


@pytest.mark.unit
def test_readme_and_configuration_name_every_preset():
    from batchfleet.common.engine_config import PRESETS  # tests/test_cli.py: the same names as the model shapes

    text = " ".join(README.read_text().split())
    (listed,) = re.findall(r"The built-in presets \((.*?)\) are built locally", text)
    assert re.findall(r"`(\w+)`:", listed) == list(PRESETS), listed
    (row,) = [line for line in (DOCS / "CONFIGURATION.md").read_text().splitlines() if line.startswith("| `--preset`")]
    named = set(re.findall(r"`(\w+)` \(", row))
    assert named == set(PRESETS), f"docs/CONFIGURATION.md's --preset row names {sorted(named)}, not {PRESETS}"


@pytest.mark.unit
def test_docs_index_names_every_document():
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"^\| \[([A-Z_]+\.md)\]\(\1\) \|", index, flags=re.M))
    documents = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert linked == documents, f"docs/README.md lacks {sorted(documents - linked)}, names {sorted(linked - documents)}"


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.unit
@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"


MAP_DOC = ROOT / "docs" / "ARCHITECTURE.md"
MAPPED_SUFFIXES = {".py", ".c", ".h", ".html"}  # the packages' source files: each has a row in the map


def map_section() -> str:
    """docs/ARCHITECTURE.md's per-file map: "## Where things are" up to "## Request lifecycle"."""
    text = MAP_DOC.read_text()
    return text[text.index("## Where things are"):text.index("## Request lifecycle")]


def mapped_files(section: str) -> set[Path]:
    """The files each row's first cell names. A name with a slash is a path from the repository root; a bare
    name lives in the folder of the last path before it in that cell (`gateway/openai/chat/routes.py`,
    `request.py`, `gateway/deps.py`, `handlers.py`: routes and request in chat/, deps and handlers in gateway/)."""
    named: set[Path] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        folder: Path | None = None
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in name:
                path = ROOT / name.rstrip("/")
                folder = path if name.endswith("/") else path.parent
            else:
                assert folder is not None, f"the map's row names {name} before any folder: {line[:80]}"
                path = folder / name
            named.add(path)
    return named


@pytest.mark.unit
def test_map_names_every_file_at_its_path():
    section = map_section()
    for path in re.findall(r"`((?:common|producer|worker|gateway|scripts|tests|deploy|docs)/[^`]*)`", section):
        assert (ROOT / path.rstrip("/")).exists(), f"docs/ARCHITECTURE.md names {path}, which does not exist"
    named = mapped_files(section)
    for path in named:
        assert path.exists(), f"docs/ARCHITECTURE.md's map names {path.relative_to(ROOT)}, which does not exist"
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in MAPPED_SUFFIXES and path.name not in ("__init__.py", "__main__.py"):
                assert path in named, f"docs/ARCHITECTURE.md's map has no row naming {path.relative_to(ROOT)}"
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        if path.name != "__init__.py":
            assert path.name in section, f"docs/ARCHITECTURE.md's scripts row does not mention {path.name}"


@pytest.mark.unit
def test_readme_folder_map_names_every_role_folder():
    """README's short map: one row per role folder of the packages (the top folders and each subfolder
    with modules of its own), and every folder it names exists."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The map"):]
    section = section[:section.index("\n## ")]
    rows = {cell.strip("` ") for cell in (line.split("|")[1] for line in section.splitlines()
                                          if line.startswith("| `"))}
    for row in rows:
        assert (ROOT / row).is_dir(), f"README's map names {row}, which is no folder"
    expected = {f"{top}/" for top in PACKAGES} | {"scripts/", "tests/", "deploy/"}
    expected |= {f"{p.parent.relative_to(ROOT)}/" for top in PACKAGES for p in (ROOT / top).glob("*/__init__.py")}
    assert expected <= rows, f"README's map lacks {sorted(expected - rows)}"
