"""The package's structure, read from its source: its rooms (sub-packages and top-level modules),
the import arrows between them, circles, imports of another module's private names, imports from
core to outside core, and functions longer than 60 lines.

    python scripts/structure.py [PACKAGE_DIR]

Every import statement counts, those inside functions too: a function-level import is how a
module avoids a circle at load time, not how it avoids depending on the other module.
test/test_layers.py checks the same facts with this module.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

LONG_FUNCTION_LINES = 60


@dataclass(frozen=True)
class Import:
    importer: str  # the importing package module
    module: str  # the imported module, absolute (outside ones too)
    name: str | None  # the name taken from it (`from module import name`), None for `import module`
    line: int


class Package:
    """The modules of the package at `package_dir` and the imports each one makes."""

    def __init__(self, package_dir: Path):
        self.dir = Path(package_dir).resolve()
        self.name = self.dir.name
        self.paths = {self._module_name(path): path for path in sorted(self.dir.rglob("*.py"))}
        self._trees: dict[str, ast.Module] = {}

    def _module_name(self, path: Path) -> str:
        parts = (self.name, *path.relative_to(self.dir).with_suffix("").parts)
        return ".".join(parts).removesuffix(".__init__")

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.paths[module]
            self._trees[module] = ast.parse(path.read_text(), str(path))
        return self._trees[module]

    def imports(self, module: str) -> list[Import]:
        """Every import statement anywhere in `module`, one entry per imported name. `from pkg import
        sub` where sub is a module imports the module sub."""
        is_package = self.paths[module].name == "__init__.py"
        package = module if is_package else module.rpartition(".")[0]
        found = []
        for node in ast.walk(self.tree(module)):
            if isinstance(node, ast.Import):
                found += [Import(module, alias.name, None, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in self.paths:
                        found.append(Import(module, submodule, None, node.lineno))
                    else:
                        found.append(Import(module, base, alias.name, node.lineno))
        return found

    def imports_of(self, module: str) -> set[str]:
        """Every module `module` imports, absolute, package modules and outside ones."""
        return {imported.module for imported in self.imports(module)}

    def module_graph(self) -> dict[str, set[str]]:
        """Package module -> the package modules it imports (not itself)."""
        return {
            module: {m for m in self.imports_of(module) if m in self.paths and m != module}
            for module in self.paths
        }

    def reachable_from(self, roots: set[str]) -> tuple[set[str], set[str]]:
        """(package modules, outside modules) reachable by imports from `roots`; importing a.b.c
        runs the packages a and a.b first."""
        seen, outside, todo = set(), set(), list(roots)
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            for imported in self.imports_of(module):
                if imported.split(".")[0] != self.name:
                    outside.add(imported)
                    continue
                parts = imported.split(".")
                todo += [p for p in (".".join(parts[:depth]) for depth in range(2, len(parts) + 1)) if p in self.paths]
        return seen, outside

    def room_of(self, module: str) -> str:
        """The room a module lives in: its sub-package, or itself for a top-level module."""
        if self.paths[module].name == "__init__.py" or module.count(".") == 1:
            return module
        return module.rpartition(".")[0]

    def rooms(self) -> set[str]:
        return {self.room_of(module) for module in self.paths if module != self.name}

    def room_graph(self) -> dict[str, set[str]]:
        """Room -> the rooms it imports from (not itself, not the top-level package)."""
        graph = {room: set() for room in self.rooms()}
        for module, imported in self.module_graph().items():
            if module == self.name:
                continue
            room = self.room_of(module)
            graph[room] |= {self.room_of(m) for m in imported if m != self.name and self.room_of(m) != room}
        return graph

    def private_imports(self) -> list[Import]:
        """Imports of a name that another package module keeps private (`from m import _name`)."""
        return [
            imported for module in self.paths for imported in self.imports(module)
            if imported.name and imported.name.startswith("_") and not imported.name.startswith("__")
            and imported.module in self.paths and imported.module != module
        ]

    def upward_imports(self, lower: str) -> list[Import]:
        """Imports from the package modules under `lower` (e.g. "sps_driving.core") of package
        modules outside it."""
        inside = (lower, lower + ".")
        return [
            imported for module in self.paths if module.startswith(inside) for imported in self.imports(module)
            if imported.module.split(".")[0] == self.name and not imported.module.startswith(inside)
        ]

    def long_functions(self, limit: int = LONG_FUNCTION_LINES) -> list[tuple[str, str, int]]:
        """(module, qualified function name, lines) of every function or method longer than `limit`
        lines, longest first."""
        found = []
        for module in self.paths:
            for qualname, node in _functions(self.tree(module)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((module, qualname, lines))
        return sorted(found, key=lambda row: -row[2])


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif successor not in index:
                index[successor] = low[successor] = len(index)
                stack.append(successor)
                on_stack.add(successor)
                work.append((successor, iter(sorted(graph.get(successor, ())))))
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
    return found


def floors(graph: dict[str, set[str]]) -> int:
    """How many floors the rooms stand on: the longest chain of imports, a circle counted as one room."""
    merged = {node: min(component) for component in circles(graph) for node in component}
    condensed: dict[str, set[str]] = {}
    for node, targets in graph.items():
        condensed.setdefault(merged.get(node, node), set()).update(merged.get(t, t) for t in targets)
    for node, targets in condensed.items():
        targets.discard(node)
    height: dict[str, int] = {}

    def floor_of(node: str) -> int:
        if node not in height:
            height[node] = 1 + max((floor_of(t) for t in condensed.get(node, ())), default=0)
        return height[node]

    return max((floor_of(node) for node in condensed), default=0)


def report(package: Package) -> str:
    module_graph, room_graph = package.module_graph(), package.room_graph()
    private, upward, long = package.private_imports(), package.upward_imports(f"{package.name}.core"), package.long_functions()
    lines = [
        f"modules: {len(package.paths)}",
        f"rooms: {len(room_graph)} on {floors(room_graph)} floors, {sum(map(len, room_graph.values()))} import arrows between them",
        f"module circles: {len(circles(module_graph))}",
        *(f"  {' <-> '.join(c)}" for c in circles(module_graph)),
        f"room circles: {len(circles(room_graph))}",
        *(f"  {' <-> '.join(c)}" for c in circles(room_graph)),
        f"core imports outside core: {len(upward)} ({len({i.module for i in upward})} modules)",
        *(f"  {i.importer}:{i.line} -> {i.module}" for i in upward),
        f"private names imported from another module: {len(private)}",
        *(f"  {i.importer}:{i.line} -> {i.module}.{i.name}" for i in private),
        f"functions over {LONG_FUNCTION_LINES} lines: {len(long)}",
        *(f"  {lines:4d} {module}.{name}" for module, name, lines in long),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "sps_driving"
    print(report(Package(root)))
