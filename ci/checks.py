"""Repository checks that uv does not do for us.

``layers``: every import of an lck package from inside another member must point strictly
downward (runtime ← kernels ← ep ← megatron). lck-megatron may import lck_ep only where the
``[ep]`` extra is declared, and only lazily (inside a function), so that installing lck-megatron
without the extra never imports lck_ep at module load.

``cycles``: no module of the four packages imports (directly or through others) a module that
imports it back. Every import statement counts, wherever it stands (a lazy import inside a function,
one under ``if TYPE_CHECKING:``): each is a dependency a reader has to untangle. An import names its
module (``from a.b import c`` names ``a.b.c`` when that is a module, else ``a.b``); the package
``__init__`` modules that Python runs on the way are not counted, or every subpackage would form a
circle with its parent.

``pins``: the root meta-package pins every member with ``==`` to exactly the member's version, and
every member's own ``lck-*==`` dependencies match the versions of the members they name.

Run: ``python ci/checks.py layers|cycles|pins|all``. Exit status 1 with one line per problem.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Layer order; a member may import only members with a strictly smaller rank.
LAYERS = {"lck_runtime": 0, "lck_kernels": 1, "lck_ep": 2, "lck_megatron": 3}
DIST = {
    "lck_runtime": "lck-runtime",
    "lck_kernels": "lck-kernels",
    "lck_ep": "lck-ep",
    "lck_megatron": "lck-megatron",
}
# (importer, imported) pairs allowed only as lazy imports, behind an optional extra.
LAZY_ONLY = {("lck_megatron", "lck_ep")}


def _imports(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(top-level module, line, at module level?) for each import statement."""
    found = []
    top_level = {id(n) for n in getattr(tree, "body", [])}
    # Imports nested in `if TYPE_CHECKING:` or try/except at module level still run at import time.
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.If, ast.Try)):
            top_level.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name.split(".")[0], node.lineno, id(node) in top_level))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module.split(".")[0], node.lineno, id(node) in top_level))
    return found


def check_layers(root: Path = ROOT) -> list[str]:
    problems = []
    for importer, rank in LAYERS.items():
        pkg_dir = root / "packages" / DIST[importer]
        for path in sorted(pkg_dir.rglob("*.py")):
            if any(part in (".venv", ".nox", "build") for part in path.parts):
                continue
            try:
                tree = ast.parse(path.read_text(), filename=str(path))
            except SyntaxError as exc:
                problems.append(f"{path.relative_to(root)}: cannot parse: {exc}")
                continue
            for mod, line, eager in _imports(tree):
                if mod not in LAYERS or mod == importer:
                    continue
                where = f"{path.relative_to(root)}:{line}"
                if (importer, mod) in LAZY_ONLY:
                    if eager and "/src/" in str(path):
                        problems.append(f"{where}: {importer} may import {mod} only lazily (optional extra)")
                    continue
                if LAYERS[mod] >= rank:
                    kind = "upward" if LAYERS[mod] > rank else "sideways"
                    problems.append(f"{where}: {kind} import of {mod} from {importer}")
    return problems


def _module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module under the members' ``src/``."""
    mods = {}
    for importer in LAYERS:
        src = root / "packages" / DIST[importer] / "src"
        for path in sorted((src / importer).rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _import_targets(tree: ast.AST, name: str, is_package: bool, mods: dict[str, Path]):
    """(imported module, line) for every import in ``tree`` that names a module in ``mods``."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in mods:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in mods:
                    yield sub, node.lineno
                elif base in mods:
                    yield base, node.lineno


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (and single modules importing themselves)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check_cycles(root: Path = ROOT) -> list[str]:
    mods = _module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as exc:
            graph[name] = {}
            print(f"{path.relative_to(root)}: cannot parse: {exc}", file=sys.stderr)
            continue
        edges: dict[str, int] = {}
        for target, line in _import_targets(tree, name, path.name == "__init__.py", mods):
            edges.setdefault(target, line)
        graph[name] = edges
    problems = []
    for comp in _strongly_connected(graph):
        members = set(comp)
        links = [
            f"{mods[a].relative_to(root)}:{graph[a][b]} imports {b}"
            for a in comp
            for b in sorted(graph[a])
            if b in members
        ]
        problems.append(f"import cycle among {', '.join(comp)}: " + "; ".join(links))
    return problems


_PIN = re.compile(r"^\s*(lck(?:-[a-z]+)?)\s*==\s*([^\s;]+)")


def _pins(deps: list[str]) -> dict[str, str]:
    out = {}
    for dep in deps:
        m = _PIN.match(dep)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def check_pins(root: Path = ROOT) -> list[str]:
    problems = []
    versions, member_deps = {}, {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        proj = tomllib.loads(pyproject.read_text())["project"]
        versions[proj["name"]] = proj["version"]
        deps = list(proj.get("dependencies", []))
        for extra in proj.get("optional-dependencies", {}).values():
            deps += extra
        member_deps[proj["name"]] = (pyproject, deps)
    for name in DIST.values():
        if name not in versions:
            problems.append(f"packages/{name}/pyproject.toml: member missing")
    meta = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    pins = _pins(meta.get("dependencies", []))
    for name, version in versions.items():
        if name not in pins:
            problems.append(f"pyproject.toml: meta-package does not pin {name} with ==")
        elif pins[name] != version:
            problems.append(
                f"pyproject.toml: pins {name}=={pins[name]} but the member's version is {version}"
            )
    for name, (pyproject, deps) in member_deps.items():
        for dep, want in _pins(deps).items():
            if dep in versions and versions[dep] != want:
                problems.append(
                    f"{pyproject.relative_to(root)}: {name} pins {dep}=={want}, member is {versions[dep]}"
                )
    return problems


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "all"
    checks = {"layers": check_layers, "cycles": check_cycles, "pins": check_pins}
    if what not in (*checks, "all"):
        print(f"usage: python ci/checks.py [layers|cycles|pins|all], got {what!r}", file=sys.stderr)
        return 2
    problems = []
    for name, check in checks.items():
        if what in (name, "all"):
            problems += check()
    for p in problems:
        print(p)
    if not problems:
        print(f"{what}: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
