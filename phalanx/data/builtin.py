"""The built-in corpus: docstrings of the installed Python standard library.

Real English prose that exists offline on any machine with Python, so `phalanx train` with no config
needs no download. Files are parsed with `ast` (nothing is imported or executed) in sorted order, so
the corpus is deterministic for a given Python installation.
"""
from __future__ import annotations

import ast
import sysconfig
from functools import lru_cache
from pathlib import Path

MAX_CHARS = 3_000_000


@lru_cache(maxsize=1)  # parsing the standard library takes seconds; preparation reads it more than once
def stdlib_docstrings(max_chars: int = MAX_CHARS) -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80:
                    docs.append(doc.strip() + "\n")
                    total += len(doc)
        if total >= max_chars:
            break
    return tuple(docs)
