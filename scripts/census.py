"""Code census of the phalanx package: module sizes, the longest functions and their parameter counts,
imports made inside functions, and import cycles between modules (read with `ast`; nothing is run).

    python scripts/census.py [PACKAGE_DIR]      # default: phalanx/ beside this script's folder
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.Module, name: str, is_pkg: bool, modules) -> tuple[set[str], int]:
    """Modules of the package this module imports (at any depth), and how many imports sit in functions."""
    found, inner = set(), 0
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        inner += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(fn))
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.update({f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names})
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found, inner


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    out, seen = [], set()

    def visit(node, stack):
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                cyc = stack[stack.index(nxt):]
                key = frozenset(cyc)
                if key not in seen:
                    seen.add(key)
                    out.append(cyc + [nxt])
            elif len(stack) < 12:
                visit(nxt, stack + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    return out


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "phalanx"
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    names = {module_name(p, root): p for p in files}
    sizes, funcs, graph, inner_total = [], [], {}, 0
    for name, path in names.items():
        src = path.read_text()
        tree = ast.parse(src)
        sizes.append((len(src.splitlines()), name))
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            args = fn.args
            n_params = len(args.posonlyargs + args.args + args.kwonlyargs) + bool(args.vararg) + bool(args.kwarg)
            n_params -= bool(args.args and args.args[0].arg in ("self", "cls"))
            funcs.append((fn.end_lineno - fn.lineno + 1, n_params, f"{name}.{fn.name}"))
        deps, inner = imports_of(tree, name, path.name == "__init__.py", names)
        inner_total += inner
        graph[name] = {d for d in deps if d in names and d != name}
    print(f"modules: {len(names)}, lines: {sum(s for s, _ in sizes)}, largest:")
    for n, name in sorted(sizes, reverse=True)[:8]:
        print(f"  {n:5d}  {name}")
    print("longest functions (lines, parameters):")
    for n, p, name in sorted(funcs, reverse=True)[:8]:
        print(f"  {n:5d}  {p:3d}  {name}")
    print("most parameters:")
    for n, p, name in sorted(funcs, key=lambda f: -f[1])[:5]:
        print(f"  {p:3d}  {name} ({n} lines)")
    print(f"imports inside functions: {inner_total}")
    found = cycles(graph)
    print(f"import cycles: {len(found)}")
    for cyc in found[:10]:
        print("  " + " -> ".join(cyc))


if __name__ == "__main__":
    main()
