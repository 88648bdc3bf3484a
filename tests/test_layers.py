"""The package's layers, as docs/architecture.md's import tables state them (the layers, and data/'s
sub-packages), enforced by reading every module with `ast` (imports inside functions count too); and the modules
that must stay torch-free."""
from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from conftest import REPO

PACKAGE = REPO / "phalanx"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def table_block(marker: str) -> str:
    text = ARCHITECTURE.read_text()
    return text[text.index(f"<!-- {marker} -->"):text.index(f"<!-- /{marker} -->")]


def layer_table() -> dict[str, set[str]]:
    rows = re.findall(r"^\| `(\w+)` \| .*? \| (.*?) \|$", table_block("LAYERS"), re.M)
    return {layer: set(re.findall(r"\w+", allowed)) for layer, allowed in rows}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "cli"  # phalanx, phalanx.cli, phalanx.__main__


def module_of(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def phalanx_imports(path):
    """(line, imported module) for every import of a phalanx module in `path`, relative ones resolved."""
    module, tree = module_of(path), ast.parse(path.read_text())
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                name = full if (REPO / full.replace(".", "/")).with_suffix(".py").exists() or \
                    (REPO / full.replace(".", "/")).is_dir() else target
                if name.startswith("phalanx"):
                    yield node.lineno, name
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("phalanx"))


def test_the_table_names_every_layer_folder():
    table = layer_table()
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(table) == folders | {"cli"}
    assert all(layer in allowed for layer, allowed in table.items())


def test_imports_only_go_where_the_table_allows():
    table, wrong = layer_table(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = layer_of(module_of(path))
        for line, name in phalanx_imports(path):
            if layer_of(name) not in table[here]:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({here}) imports {name} ({layer_of(name)})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", ["phalanx.tools.report", "phalanx.core.config", "phalanx.core.runfolder",
                                    "phalanx.cli"])
def test_torch_free_modules(module):
    """`phalanx report` and the config checks work without importing torch (and start fast)."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# data/'s reading seam, in the direction its imports go: where a source's files are listed and opened,
# planned into pieces, read into records and checked, stored. A module may import only those after it.
SEAM = ("sources", "readers", "store")


def seam_back_imports(imports: dict[str, set[str]]) -> list[str]:
    """'a imports b' for every seam module that imports one before it (`imports`: module -> data modules)."""
    return [f"data/{a}.py imports data/{b}.py" for i, a in enumerate(SEAM) for b in SEAM[:i]
            if b in imports.get(a, set())]


def test_the_reading_seam_imports_in_one_direction():
    imports = {name: {m.split(".")[2] for _, m in phalanx_imports(PACKAGE / "data" / f"{name}.py")
                      if m.startswith("phalanx.data.")} for name in SEAM}
    assert not seam_back_imports(imports)
    assert imports["sources"] >= {"readers"}  # the seam is used as drawn
    # control: an import back up the seam is found
    assert seam_back_imports({**imports, "readers": imports["readers"] | {"sources"}}) == \
        ["data/readers.py imports data/sources.py"]


# data/ by concern: the generic pipeline (sources, readers, the token store, samplers, prepare, the store
# of units) in data/ itself, each task's record format in a sub-package, object storage in data/remote/. A
# sub-package may use the generic pipeline and the sub-packages its row names; the generic pipeline uses remote/
# (where a store lives, its node-local cache) and no task's format (a format plugs in through the task, tasks/);
# remote/ knows of a store only its on-disk layout (data/layout.py, a leaf).
DATA_PACKAGES = {"data.layout": {"data.layout"}, "data.remote": {"data.remote", "data.layout"},
                 "data": {"data", "data.layout", "data.remote"}, "data.chat": {"data", "data.layout", "data.chat"},
                 "data.pref": {"data", "data.layout", "data.chat", "data.pref"},
                 "data.classify": {"data", "data.layout", "data.classify"},
                 "data.grpo": {"data", "data.layout", "data.chat", "data.grpo"},
                 "data.tokcls": {"data", "data.layout", "data.tokcls"}}


def data_package(module: str) -> str:
    """phalanx.data.chat.store -> data.chat; phalanx.data.layout -> data.layout; phalanx.data.store -> data."""
    parts = module.split(".")
    if parts[2] == "layout":
        return "data.layout"
    return f"data.{parts[2]}" if len(parts) > 3 or (PACKAGE / "data" / parts[2]).is_dir() else "data"


def data_back_imports(imports: list[tuple[str, str]]) -> list[str]:
    return [f"{a} ({data_package(a)}) imports {b} ({data_package(b)})" for a, b in imports
            if data_package(b) not in DATA_PACKAGES[data_package(a)]]


def test_the_documented_data_table_is_the_tested_one():
    rows = re.findall(r"^\| `([\w.]+)`[^|]*\| (.*?) \|$", table_block("DATA-PACKAGES"), re.M)
    assert {package: set(re.findall(r"`([\w.]+)`", allowed)) for package, allowed in rows} == DATA_PACKAGES


def test_data_sub_packages_import_one_way():
    imports = [(module_of(path), name) for path in sorted((PACKAGE / "data").rglob("*.py"))
               for _, name in phalanx_imports(path) if name.startswith("phalanx.data.")]
    assert {data_package(m) for m, _ in imports} == set(DATA_PACKAGES) - {"data.layout"}  # each one is seen
    assert not data_back_imports(imports)
    # control: the generic pipeline importing a task's format is found
    assert data_back_imports([("phalanx.data.prepare", "phalanx.data.chat.store")]) == \
        ["phalanx.data.prepare (data) imports phalanx.data.chat.store (data.chat)"]
