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


def _public_modules():
    """(dotted name, parsed tree) of the standard library's public modules (no tests, no _private parts), in a
    fixed order; a file Python cannot parse is left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if {"site-packages", "test", "tests", "idlelib"} & set(parts) or any(
                part.startswith("_") and part != "__init__.py" for part in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        yield ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"), tree


SYSTEM = "You answer questions about the Python standard library in one short paragraph."
QUESTIONS = ("What does `{}` do?", "Explain `{}` briefly.", "What is `{}` for?")


def _first_paragraph(doc: str, limit: int = 400) -> str:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _documented(tree: ast.Module, module: str):
    """(qualified name, first paragraph) of the module's top-level functions and classes and their methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:
                yield f"{module}.{node.name}", _first_paragraph(doc)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    doc = ast.get_docstring(sub) if isinstance(sub, ast.FunctionDef) else None
                    if doc and len(doc) >= 80 and not sub.name.startswith("_"):
                        yield f"{module}.{node.name}.{sub.name}", _first_paragraph(doc)


@lru_cache(maxsize=1)
def stdlib_conversations(max_chars: int = MAX_CHARS // 2) -> tuple[dict, ...]:
    """Question/answer conversations (messages format) made from the standard library's docstrings: the
    built-in chat data set. Pairs of names from one module make two-turn conversations; every third one
    has a system message. Deterministic for a given Python installation, offline."""
    out, total = [], 0
    for module, tree in _public_modules():
        items = list(_documented(tree, module))
        for i in range(0, len(items) - 1, 2):
            (a, answer_a), (b, answer_b) = items[i], items[i + 1]
            n = len(out)
            messages = [{"role": "system", "content": SYSTEM}] if n % 3 == 0 else []
            messages += [{"role": "user", "content": QUESTIONS[n % 3].format(a)},
                         {"role": "assistant", "content": answer_a},
                         {"role": "user", "content": f"And `{b}`?"},
                         {"role": "assistant", "content": answer_b}]
            out.append({"messages": messages})
            total += len(answer_a) + len(answer_b)
        if total >= max_chars:
            break
    return tuple(out)


def _corrupted(text: str, seed: int) -> str:
    """The reply's words in a shuffled order (seeded: the same every time): fluent text made wrong."""
    import random

    words = text.split()
    for k in range(8):  # a reply of one repeated word cannot be reordered into another text
        random.Random(seed * 8 + k).shuffle(words)
        if " ".join(words) != " ".join(text.split()):
            break
    return " ".join(words)


@lru_cache(maxsize=1)
def stdlib_preference_pairs() -> tuple[dict, ...]:
    """Preference pairs (explicit prompt, lists of messages) made from the built-in conversations: the prompt is
    a conversation up to its last reply, the chosen reply that reply, the rejected one the same words
    shuffled. The built-in data of `task: preference`; deterministic, offline."""
    out = []
    for n, record in enumerate(stdlib_conversations()):
        messages = record["messages"]
        reply = messages[-1]["content"]
        wrong = _corrupted(reply, n)
        if wrong == " ".join(reply.split()):
            continue
        out.append({"prompt": messages[:-1], "chosen": [messages[-1]],
                    "rejected": [{"role": "assistant", "content": wrong}]})
    return tuple(out)


def _words(text: str) -> list[str]:
    """Words with punctuation at their ends split off, as NER corpora tokenize ('(see', 'json.')."""
    out = []
    for raw in text.split():
        lead = len(raw) - len(raw.lstrip("([{'\"`"))
        core = raw[lead:]
        tail = len(core) - len(core.rstrip(".,;:!?)]}'\"`"))
        core, end = (core[:len(core) - tail], core[len(core) - tail:]) if tail else (core, "")
        out += list(raw[:lead]) + ([core] if core else []) + list(end)
    return out


def _tagged(module: str, name: str, doc: str, n: int) -> tuple[list[str], list[str]]:
    """One sentence about `module`.`name` (a function, or Class.method as three words) with the module and
    function names tagged (B-MODULE; B-FUNCTION I-FUNCTION ...), in one of three frames so position alone does
    not give the tags away."""
    parts = name.split(".")
    func = [w for p in parts for w in (p, ".")][:-1]
    func_tags = ["B-FUNCTION"] + ["I-FUNCTION"] * (len(func) - 1)
    words = _words(doc.split(". ")[0].rstrip(".") + ".")
    doc_tags = ["B-MODULE" if w == module else "B-FUNCTION" if w == parts[-1] else "O" for w in words]
    frames = [(func + ["in", module, ":"], func_tags + ["O", "B-MODULE", "O"], words, doc_tags),
              (["The", module, "module", "has"] + func + [":"], ["O", "B-MODULE", "O", "O"] + func_tags + ["O"],
               words, doc_tags),
              (words[:-1], doc_tags[:-1], ["(", "see"] + func + ["in", module, ")", "."],
               ["O", "O"] + func_tags + ["O", "B-MODULE", "O", "O"])]
    a, a_tags, b, b_tags = frames[n % 3]
    return a + b, a_tags + b_tags


@lru_cache(maxsize=1)
def stdlib_tagged(max_sentences: int = 6000) -> tuple[tuple[list[str], list[str]], ...]:
    """(words, tags) sentences about the standard library's documented functions and methods, with module and
    function names tagged: the built-in data of `task: token_classify`. Deterministic, offline."""
    out = []
    for module, tree in _public_modules():
        for qualified, doc in _documented(tree, module):
            out.append(_tagged(module, qualified[len(module) + 1:], doc, len(out)))
            if len(out) >= max_sentences:
                return tuple(out)
    return tuple(out)


def records(fields: tuple) -> tuple:
    """The built-in rows for a record format's fields ((name, kind), ...): tagged sentences (words, tags) for a
    'words' field, preference pairs for a whole-row field named 'pair', conversations for another whole-row
    field, else the docstrings (text)."""
    if any(kind == "words" for _, kind in fields):
        return stdlib_tagged()
    whole = [name for name, kind in fields if kind == "record"]
    if not whole:
        return stdlib_docstrings()
    return stdlib_preference_pairs() if whole[0] == "pair" else stdlib_conversations()
