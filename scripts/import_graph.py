"""Import graph of a package (module-level AND function-level imports), with its cycles.

Usage: python import_graph.py [ROOT=/work/main] [PKG=infinipipe_hf] [--edges] [--outside DIR ...]
       python import_graph.py /work/main/benchmarks .      (script folders: modules named from ROOT)
       --parents: also count the parent packages an import runs (a.b.c runs a/__init__, a/b/__init__)

Every `import x` / `from x import y` / relative import anywhere in a module body (including inside
functions, methods, `if TYPE_CHECKING:` blocks and try/except) becomes an edge module -> module,
tagged `top` (executed at import time) or `func` (inside a def/lambda) and `tc` (under
`if TYPE_CHECKING`).  `from pkg import name` resolves to `pkg.name` when that is a module, else
to `pkg` (its __init__).  Strongly connected components (Tarjan) of size > 1 or with a self-loop
are the cycles; each is printed with the edges inside it, and with the elementary cycles
(Johnson-style enumeration, bounded).
"""
from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict


def find_modules(root: str, pkg: str) -> dict[str, str]:
    """Modules under root/pkg named from root (pkg "." : every module under root, for script
    folders such as benchmarks/ that import each other as top-level modules)."""
    mods = {}
    for d, _, files in os.walk(os.path.join(root, pkg) if pkg != "." else root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                if rel == "__init__":
                    continue
                if rel.endswith(".__init__"):
                    rel = rel[: -len(".__init__")]
                mods[rel] = path
    return mods


def _is_pkg(path: str) -> bool:
    return path.endswith("__init__.py")


class Visitor(ast.NodeVisitor):
    def __init__(self, mod: str, path: str, mods: dict[str, str]):
        self.mod, self.path, self.mods = mod, path, mods
        self.pkg = mod if _is_pkg(path) else mod.rpartition(".")[0]
        self.func_depth = 0
        self.tc_depth = 0
        self.edges: list[tuple[str, str, str, int]] = []  # (src, dst, kind, line)

    def _kind(self) -> str:
        k = "func" if self.func_depth else "top"
        return k + ("+tc" if self.tc_depth else "")

    def _resolve(self, name: str) -> str | None:
        # longest prefix of name that is a known module
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in self.mods:
                return cand
        return None

    def _add(self, target: str | None, line: int):
        if target and target != self.mod:
            self.edges.append((self.mod, target, self._kind(), line))
        elif target == self.mod:
            self.edges.append((self.mod, target, self._kind(), line))

    def visit_FunctionDef(self, node):
        self.func_depth += 1
        self.generic_visit(node)
        self.func_depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        t = node.test
        is_tc = (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
            isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")
        if is_tc:
            self.tc_depth += 1
            for n in node.body:
                self.visit(n)
            self.tc_depth -= 1
            for n in node.orelse:
                self.visit(n)
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        for a in node.names:
            self._add(self._resolve(a.name), node.lineno)

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.pkg.split(".")
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            base = ".".join(base)
            full = f"{base}.{node.module}" if node.module else base
        else:
            full = node.module or ""
        for a in node.names:
            sub = f"{full}.{a.name}"
            if sub in self.mods:
                self._add(sub, node.lineno)
            else:
                self._add(self._resolve(full), node.lineno)

    def visit_Call(self, node):
        # importlib.import_module("x.y") with a literal string
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "import_module" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            self._add(self._resolve(node.args[0].value), node.lineno)
        self.generic_visit(node)


def lazy_tables(mod: str, path: str, mods) -> list[tuple[str, str, str, int]]:
    """`_LAZY = {"Name": ("pkg.mod", "attr")}` tables used by __getattr__ count as func edges."""
    out = []
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            name = node.elts[0].value
            if name in mods and name != mod:
                out.append((mod, name, "func(lazy)", node.lineno))
    return out


def build(root: str, pkg: str):
    mods = find_modules(root, pkg)
    edges = []
    for m, p in sorted(mods.items()):
        v = Visitor(m, p, mods)
        v.visit(ast.parse(open(p).read(), p))
        edges += v.edges + lazy_tables(m, p, mods)
    # importing a.b.c also runs a/__init__ and a/b/__init__: with --parents those count as edges
    if "--parents" in sys.argv:
        extra = []
        for s, d, k, ln in edges:
            parts = d.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in mods and parent != s and not s.startswith(parent + "."):
                    extra.append((s, parent, k + "(parent)", ln))
        edges += extra
    return mods, edges


def tarjan(nodes, adj):
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in adj[v]:
            if w not in index:
                strong(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def simple_cycles(comp, adj, limit=200):
    """Elementary cycles inside one SCC (small graphs: plain DFS from each start, canonical)."""
    comp_set, order = set(comp), {n: i for i, n in enumerate(sorted(comp))}
    found = []

    def dfs(start, v, path, seen):
        for w in sorted(adj[v]):
            if w not in comp_set or order[w] < order[start]:
                continue
            if w == start:
                found.append(path + [start])
                if len(found) >= limit:
                    return
            elif w not in seen:
                seen.add(w); dfs(start, w, path + [w], seen); seen.discard(w)

    for s in sorted(comp):
        dfs(s, s, [s], {s})
    return found


def main(argv):
    root = argv[0] if argv and not argv[0].startswith("-") else "/work/main"
    pkg = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else "infinipipe_hf"
    mods, edges = build(root, pkg)
    ekinds = defaultdict(set)
    elines = defaultdict(list)
    for s, d, k, ln in edges:
        if s == d:
            continue
        ekinds[(s, d)].add(k)
        elines[(s, d)].append(ln)

    def report(title, keep):
        adj = defaultdict(set)
        for (s, d), ks in ekinds.items():
            if any(keep(k) for k in ks):
                adj[s].add(d)
        sccs = [c for c in tarjan(mods, adj) if len(c) > 1]
        print(f"## {title}: {len(sccs)} strongly connected component(s) of size > 1")
        short = lambda m: m[len(pkg) + 1:] if pkg != "." and m.startswith(pkg + ".") else m
        for c in sccs:
            print(f"\n### SCC ({len(c)} modules): " + ", ".join(short(m) for m in c))
            for s in c:
                for d in sorted(adj[s]):
                    if d in c:
                        ks = "/".join(sorted(ekinds[(s, d)]))
                        ls = ",".join(str(x) for x in sorted(set(elines[(s, d)])))
                        print(f"  {short(s)} -> {short(d)}   [{ks}] line {ls}")
            cyc = simple_cycles(c, adj)
            print(f"  elementary cycles ({len(cyc)}{'+' if len(cyc) >= 200 else ''}):")
            for cy in sorted(cyc, key=len)[:40]:
                print("    " + " -> ".join(short(m) for m in cy))
        print()

    report("all imports (module-level + function-level + TYPE_CHECKING + lazy tables)", lambda k: True)
    report("module-level imports only (executed at import time, no TYPE_CHECKING)",
           lambda k: k == "top")
    if "--edges" in argv:
        print("## edges")
        for (s, d), ks in sorted(ekinds.items()):
            print(f"{s} -> {d} [{'/'.join(sorted(ks))}] {sorted(set(elines[(s, d)]))}")
    if "--outside" in argv:
        i = argv.index("--outside")
        outside = defaultdict(set)
        for top in argv[i + 1:]:
            for d, _, files in os.walk(os.path.join(root, top)):
                if ".venv" in d or "/." in d:
                    continue
                for f in files:
                    if not f.endswith(".py"):
                        continue
                    p = os.path.join(d, f)
                    try:
                        tree = ast.parse(open(p).read(), p)
                    except SyntaxError:
                        continue
                    for node in ast.walk(tree):
                        names = []
                        if isinstance(node, ast.Import):
                            names = [a.name for a in node.names]
                        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                                     else f"{node.module}:{a.name}" for a in node.names]
                        for n in names:
                            if n.startswith(pkg):
                                outside[n].add(os.path.relpath(p, root))
        print("## imports of the package from outside it")
        for n in sorted(outside):
            print(f"{n}: {', '.join(sorted(outside[n]))}")


if __name__ == "__main__":
    main(sys.argv[1:])
