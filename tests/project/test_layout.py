"""The layout keeps the architecture: no import circles, no layer importing upward, no private names borrowed.

Every import counts, also one inside a function or under `if TYPE_CHECKING:` (a circle hidden in a function is
still a circle: each module needs the other). The layers of vbmc are those its package docstring lists.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
PACKAGES = ("vbmc", "controller", "kubesim")

# Who may import whom, inside vbmc: a module of the key's package may import the listed packages (and its own).
# Most specific key first; "vbmc" alone is the package's own modules (cli, demo, __main__): entry points.
VBMC_LAYERS: dict[str, tuple[str, ...]] = {
    "vbmc.access": (),
    "vbmc.machine.kubevirt": ("vbmc.machine", "vbmc.access"),
    "vbmc.machine": ("vbmc.access",),
    "vbmc.ipmi": ("vbmc.machine", "vbmc.access"),
    "vbmc.redfish": ("vbmc.machine", "vbmc.access"),
    "vbmc.web": ("vbmc.machine", "vbmc.access", "vbmc.redfish"),
    "vbmc.agent": ("vbmc.machine", "vbmc.access", "vbmc.ipmi", "vbmc.redfish", "vbmc.web"),
}
# Outside its own backend package, nothing in the machine layer or a frontend may import a backend.
BACKEND = "vbmc.machine.kubevirt"
# The three top-level packages: the agent and the controller share nothing; kubesim serves them both and imports
# neither; only the `kubevbmc` command's entry points (vbmc.cli, vbmc.demo) tie them together.
TOP_LEVEL = {"controller": {"controller"}, "kubesim": {"kubesim"}}
ENTRY_POINTS = {"vbmc.cli", "vbmc.demo"}


@dataclass(frozen=True)
class Import:
    importer: str  # the module
    module: str  # the module imported (a package's __init__ counts as the package)
    names: tuple[str, ...]  # the names taken from it (`from module import names`); () for `import module`
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


MODULES = modules()


def imports_of(name: str, path: Path) -> Iterator[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [a.name for a in node.names if f"{target}.{a.name}" in MODULES]
            names = tuple(a.name for a in node.names if f"{target}.{a.name}" not in MODULES)
            for sub in submodules:
                yield Import(name, f"{target}.{sub}", (), node.lineno)
            if names or not submodules:
                yield Import(name, target, names, node.lineno)


ALL_IMPORTS = [imp for name, path in MODULES.items() for imp in imports_of(name, path)]
OURS = [imp for imp in ALL_IMPORTS if imp.module.split(".")[0] in PACKAGES]


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for imp in OURS:
        if imp.module in MODULES and imp.module != imp.importer:
            edges[imp.importer].add(imp.module)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    assert circles(graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def layer_of(module: str) -> str | None:
    for layer in VBMC_LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward(imp: Import) -> str:
    """Why this import breaks the layering, or ""."""
    here, there = imp.importer, imp.module
    top_here, top_there = here.split(".")[0], there.split(".")[0]
    if top_here in TOP_LEVEL and top_there not in TOP_LEVEL[top_here]:
        return f"{top_here} imports {top_there}"
    if top_here == "vbmc" and top_there != "vbmc" and here not in ENTRY_POINTS:
        return f"only the entry points of vbmc import {top_there}"
    if top_here != "vbmc" or top_there != "vbmc":
        return ""
    layer, target = layer_of(here), layer_of(there)
    if layer is None:
        return ""  # an entry point: may import anything
    if target is None:
        return f"{layer} imports the entry point {there}"
    if within(there, BACKEND) and not within(here, BACKEND) and layer != "vbmc.agent":
        return f"{layer} imports the KubeVirt backend"
    if target == layer or any(within(target, allowed) for allowed in VBMC_LAYERS[layer]):
        return ""
    return f"{layer} may not import {target}"


def test_no_layer_imports_upward() -> None:
    assert [f"{imp.importer}:{imp.line} imports {imp.module}: {why}" for imp in OURS if (why := upward(imp))] == []


@pytest.mark.parametrize(("importer", "module", "broken"), [
    ("vbmc.ipmi.server", "vbmc.redfish.app", True),
    ("vbmc.machine.model", "vbmc.ipmi.codec", True),
    ("vbmc.redfish.systems", "vbmc.machine.kubevirt.vmstate", True),
    ("vbmc.access.audit", "vbmc.machine", True),
    ("vbmc.machine.kubevirt.machine", "vbmc.agent.bmc", True),
    ("controller.reconciler", "vbmc.agent", True),
    ("kubesim.kubelet", "controller.desired", True),
    ("vbmc.agent.runtime", "kubesim.cluster", True),
    ("vbmc.agent.runtime", "vbmc.machine.kubevirt.client", False),
    ("vbmc.redfish.app", "vbmc.machine", False),
    ("vbmc.demo", "kubesim.cluster", False),
])
def test_the_layer_check_tells_upward_from_downward(importer: str, module: str, broken: bool) -> None:
    assert bool(upward(Import(importer, module, (), 1))) is broken


def test_no_module_imports_a_private_name_of_another() -> None:
    borrowed = [f"{imp.importer}:{imp.line} takes {name} from {imp.module}"
                for imp in OURS for name in imp.names
                if name.startswith("_") and not name.startswith("__") and imp.module != imp.importer]
    assert borrowed == []


def test_no_module_reaches_into_a_private_attribute_of_another_of_ours() -> None:
    """`module._name` where `module` is one of our modules, imported by name."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = {imp_alias(imp) for imp in OURS if imp.importer == name and not imp.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert found == []


def imp_alias(imp: Import) -> str:
    return imp.module.rpartition(".")[2]


def test_every_package_says_what_it_is_and_what_it_may_import() -> None:
    for name, path in MODULES.items():
        if path.name != "__init__.py" or (name.count(".") == 0 and name != "vbmc"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert doc, f"{name} has no docstring"
        if name.startswith("vbmc."):
            assert "import" in doc.lower(), f"{name}'s docstring does not say what it may import"
