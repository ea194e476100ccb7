"""The packages form layers: models (the domain) imports no other package of ours; runtime imports models only,
and neither torch nor transformers (it is what serves); server imports runtime and models; export may import
them all but server; and no module imports itself back through a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "runtime", "server", "export")
ALLOWED = {"models": set(), "runtime": {"models"}, "server": {"models", "runtime"},
           "export": {"models", "runtime"}}
SERVING_FORBIDDEN = ("torch", "transformers", "onnx", "safetensors")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["systemone", *parts])


def imports(path: Path) -> set[str]:
    """Every module `path` imports (deferred imports included), as absolute names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: {m for m in imports(path) if m in modules} for name, path in modules.items()}, modules


def test_no_package_imports_a_layer_above_it():
    edges, modules = graph()
    for name, path in modules.items():
        layer = name.split(".")[1]
        for target in imports(path):
            parts = target.split(".")
            if parts[0] == "systemone" and len(parts) > 1 and parts[1] in PACKAGES and parts[1] != layer:
                assert parts[1] in ALLOWED[layer], f"{name} imports {target}"


def test_serving_imports_no_torch():
    _, modules = graph()
    for name, path in modules.items():
        if name.split(".")[1] in ("models", "runtime", "server"):
            bad = {m for m in imports(path) if m.split(".")[0] in SERVING_FORBIDDEN}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_no_import_cycles():
    edges, _ = graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*trail, node, nxt])
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [])


def test_tests_import_nothing_from_scripts():
    """scripts/ holds tools someone runs; what a test needs lives in the package or beside the tests."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        named += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level]
        assert not [name for name in named if name.split(".")[0] == "scripts"], path.name
