"""The packages' layering: who may import whom, no import cycles, and the hook's lean imports.

Every module of ``controller``, ``env``, ``agents`` and ``sglang_hook`` belongs to one layer,
and a module may import (at its top, inside a function, or for type checking alike) only
modules of its own layer and of the layers :data:`MAY_IMPORT` lists for it:

==============  ==========================================================  =====================
layer           modules                                                     may import
==============  ==========================================================  =====================
foundation      controller.errors, controller._jit, controller.cpus         —
protocol        controller.protocol (the wire schema)                       foundation
base            controller.features, .policy (the interface), .traces,      protocol, foundation
                .objective
policies        controller.baselines, .ppo_policy, .registry                base and below
service         controller.service, .polling, .metrics                      policies and below
hook            sglang_hook.* (runs inside SGLang)                          controller.protocol,
                                                                            .errors only
simulator       env.*                                                       policies and below
agents          agents.* (training, evaluation, the demo)                   everything but cli
cli             controller.cli                                              everything
==============  ==========================================================  =====================

So the shared base (protocol, errors, Featurizer, trace format, policy interface) imports
neither the simulator, nor training, nor the service, nor the hook. ``controller.cli`` is the one
top module: it reaches the subcommands of every layer, by name (``SUBCOMMAND_MODULES``), and
nothing imports it. The import graph has no cycle, and the hook, with everything it imports,
needs nothing but the standard library, pyzmq, msgpack, numpy and SGLang itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("controller", "env", "agents", "sglang_hook")

LAYERS: dict[str, tuple[str, ...]] = {
    "foundation": ("controller", "controller.errors", "controller._jit", "controller.cpus"),
    "protocol": ("controller.protocol",),
    "base": ("controller.features", "controller.policy", "controller.traces", "controller.objective"),
    "policies": ("controller.baselines", "controller.ppo_policy", "controller.registry"),
    "service": ("controller.polling", "controller.metrics", "controller.service"),
    "hook": ("sglang_hook.*",),
    "simulator": ("env.*",),
    "agents": ("agents.*",),
    "cli": ("controller.cli",),
}
_BELOW_POLICIES = {"foundation", "protocol", "base", "policies"}
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": set(),
    "protocol": {"foundation"},
    "base": {"foundation", "protocol"},
    "policies": {"foundation", "protocol", "base"},
    "service": _BELOW_POLICIES,
    "hook": {"foundation", "protocol"},  # and of those, only HOOK_MAY_IMPORT
    "simulator": _BELOW_POLICIES,
    "agents": _BELOW_POLICIES | {"service", "hook", "simulator"},
    "cli": set(LAYERS),
}
HOOK_MAY_IMPORT = {"controller.protocol", "controller.errors"}
HOOK_THIRD_PARTY = {"zmq", "msgpack", "numpy", "sglang"}


# ----------------------------------------------------------------------------- the graph


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages (``pkg.sub.mod``, packages by their ``__init__``)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: Iterable[str]) -> tuple[set[str], set[str]]:
    """(project modules, other top-level packages) that module ``name`` imports, anywhere in it."""
    known = set(known)
    project: set[str] = set()
    other: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def add(target: str) -> None:
        if target.split(".")[0] in PACKAGES:
            while target not in known and "." in target:  # `from pkg import name`: the module
                target = target.rpartition(".")[0]
            project.add(target)
        else:
            other.add(target.split(".")[0])

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base)
    project.discard(name)
    return project, other


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = project_modules(root)
    graph, third = {}, {}
    for name, path in modules.items():
        graph[name], other = imports_of(name, path, modules)
        third[name] = {m for m in other if m not in sys.stdlib_module_names and m != "__future__"}
    return graph, third


def layer_of(module: str) -> str | None:
    """The layer that lists ``module`` (``pkg.*``: the package and everything in it), or None."""
    for layer, names in LAYERS.items():
        for name in names:
            if module == name.removesuffix(".*") or (name.endswith(".*") and module.startswith(name[:-1])):
                return layer
    return None


def layering_violations(graph: Mapping[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        if layer is None:
            out.append(f"{module}: in no layer (add it to LAYERS)")
            continue
        for target in sorted(targets):
            t_layer = layer_of(target)
            if t_layer is None or (t_layer != layer and t_layer not in MAY_IMPORT[layer]):
                out.append(f"{module} ({layer}) imports {target} ({t_layer})")
            elif layer == "hook" and t_layer != "hook" and target not in HOOK_MAY_IMPORT:
                out.append(
                    f"{module} (hook) imports {target}: the hook may import only {sorted(HOOK_MAY_IMPORT)}"
                )
    return out


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def closure(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


# ----------------------------------------------------------------------------- the tests


def test_every_import_goes_down_the_layers() -> None:
    graph, _ = import_graph()
    assert "controller.service" in graph and "sglang_hook.client" in graph  # the walk found the tree
    problems = layering_violations(graph)
    assert not problems, "\n".join(problems)


def test_there_is_no_import_cycle() -> None:
    graph, _ = import_graph()
    found = cycles(graph)
    assert not found, found


def test_the_hook_needs_nothing_beyond_stdlib_pyzmq_msgpack_numpy_and_sglang() -> None:
    graph, third = import_graph()
    for module in (m for m in graph if layer_of(m) == "hook"):
        reach = closure(graph, module)
        assert {m for m in reach if layer_of(m) != "hook"} <= HOOK_MAY_IMPORT, (module, sorted(reach))
        needs = set().union(*(third[m] for m in reach))
        assert needs <= HOOK_THIRD_PARTY, (module, sorted(needs - HOOK_THIRD_PARTY))


def test_importing_the_hook_loads_only_lean_modules() -> None:
    """At run time too, compared with a bare interpreter (site hooks may preload modules)."""
    hook = sorted(m for m in project_modules() if layer_of(m) == "hook")
    code = (
        "import sys; before = set(sys.modules); "
        + "; ".join(f"import {m}" for m in hook)
        + "; new = set(sys.modules) - before; "
        "print(sorted(m for m in new if m.split('.')[0] in ('controller', 'env', 'agents'))); "
        "print(sorted({m.split('.')[0] for m in new if m.split('.')[0] not in sys.stdlib_module_names "
        "and not m.startswith('_')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    project, other = (eval(line) for line in out.stdout.splitlines())
    assert set(project) <= HOOK_MAY_IMPORT | {"controller"}, project
    assert set(other) <= {"controller", "sglang_hook", "zmq", "msgpack", "numpy", "cython_runtime"}, other


def test_the_checks_find_what_they_look_for() -> None:
    """The rules can fail: a base module importing the simulator, a cycle, an unplaced module,
    the hook reaching past the protocol."""
    bad = {
        "controller.features": {"env.engine"},
        "env.engine": {"controller.features"},
        "controller.stray": set(),
        "sglang_hook.plugin": {"controller.features"},
    }
    problems = layering_violations(bad)
    assert any("controller.features (base) imports env.engine" in p for p in problems), problems
    assert any("controller.stray: in no layer" in p for p in problems), problems
    assert any("sglang_hook.plugin (hook) imports controller.features" in p for p in problems), problems
    assert cycles(bad) == [["controller.features", "env.engine"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_relative_and_from_imports_resolve_to_modules(tmp_path: Path) -> None:
    pkg = tmp_path / "controller"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom .b import thing\nfrom controller import c\n")
    (pkg / "b.py").write_text("def f():\n    import env.engine\n")
    (pkg / "c.py").write_text("")
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "engine.py").write_text("")
    modules = project_modules(tmp_path)
    assert imports_of("controller.a", pkg / "a.py", modules)[0] == {"controller.b", "controller.c"}
    assert imports_of("controller.b", pkg / "b.py", modules)[0] == {"env.engine"}  # a lazy import counts


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_every_layer_has_modules(layer: str) -> None:
    assert any(layer_of(m) == layer for m in project_modules()), layer
