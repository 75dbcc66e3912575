"""The package's layout keeps its rules: no import cycles (imports inside
functions count), each module imports only those before it in ``ORDER``
(docs/design.md, "Modules"), and only ``_native.py`` imports the native
library.  Each verdict is set in one place (``C.settle`` only in
``_verdicts.py``, REUSED only natively) and one module binds the native
hooks (``C.bind``).  Read from the source (``ast``), every ``import``
statement wherever it is.
"""
import ast
import collections
import os
import re

import pytest

import torch_xla_donate

ROOT = os.path.dirname(torch_xla_donate.__file__)
# Every module, in the order it may be imported: each imports only those
# before it.
ORDER = ["errors", "_native", "_messages", "_xla", "_xla_cpu", "_guards", "_config", "_poison",
         "_holders", "_auto", "_verdicts", "report", "_marking", "_trees", "_donating",
         "_commit", "_dynamo", "_hooks", "", "__main__"]
ORDER = ["torch_xla_donate" + (f".{m}" if m else "") for m in ORDER]


def _modules():
    """{module name: path} of every Python module of the package."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name, path):
    """The package modules ``name`` imports, at any depth of its code."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torch_xla_donate"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("torch_xla_donate"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES or sub.endswith("._C") else target)
    return found - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_module_is_in_the_order():
    assert sorted(MODULES) == sorted(ORDER)


def test_the_import_graph_has_no_cycle():
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(GRAPH.get(n, ())):
            if m not in GRAPH:
                continue
            if state.get(m) == "open":
                cycle = stack[stack.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(GRAPH):
        if n not in state:
            visit(n)


@pytest.mark.parametrize("name", ORDER)
def test_each_module_imports_only_those_before_it(name):
    mine = ORDER.index(name)
    later = {m for m in GRAPH.get(name, ()) if m in ORDER and ORDER.index(m) > mine}
    assert not later, f"{name} imports {sorted(later)}, which come after it"


def test_only_native_imports_the_extension():
    importers = sorted(n for n, deps in GRAPH.items() if any(d.endswith("._C") for d in deps))
    assert importers == ["torch_xla_donate._native"]


def test_the_checker_sees_relative_and_function_level_imports(tmp_path):
    """The rules would pass vacuously if imports were missed."""
    assert "torch_xla_donate._native" in GRAPH["torch_xla_donate._guards"]
    assert "torch_xla_donate._verdicts" in GRAPH["torch_xla_donate.report"]
    assert GRAPH["torch_xla_donate._trees"] >= {
        "torch_xla_donate._marking", "torch_xla_donate._poison"}
    source = "def f():\n    from . import _commit as commit\n"
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert _imports("torch_xla_donate.probe", str(path)) == {"torch_xla_donate._commit"}


# -- Calls into the native library that only one place may make --------------


def _native_calls(attr):
    """{module name: [(enclosing function, call node)]} of the calls
    ``C.<attr>(...)`` (or ``_C.<attr>``) in the package's sources."""
    found = collections.defaultdict(list)

    def visit(name, node, function):
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr == attr and isinstance(child.func.value, ast.Name)
                    and child.func.value.id in ("C", "_C")):
                found[name].append((function, child))
            visit(name, child, inner)

    for name, path in MODULES.items():
        with open(path) as f:
            visit(name, ast.parse(f.read(), path), "<module>")
    return dict(found)


def _verdict_named(call):
    """``X`` of a ``C.settle(record, C.Verdict.X)`` call, None for a verdict
    passed in a variable."""
    arg = call.args[1] if len(call.args) > 1 else None
    return arg.attr if isinstance(arg, ast.Attribute) else None


def test_only_verdicts_settles_a_record():
    assert set(_native_calls("settle")) == {"torch_xla_donate._verdicts"}


def test_each_verdict_is_set_by_one_function():
    """REUSED and UPDATED_IN_PLACE are decided natively only; every other
    verdict named in Python is settled by one function."""
    setters = collections.defaultdict(set)
    for name, calls in _native_calls("settle").items():
        for function, call in calls:
            verdict = _verdict_named(call)
            if verdict is not None:
                setters[verdict].add(f"{name}.{function}")
    assert not setters.keys() & {"REUSED", "UPDATED_IN_PLACE"}, dict(setters)
    shared = {v: sorted(f) for v, f in setters.items() if len(f) > 1}
    assert not shared, f"verdicts set from more than one function: {shared}"
    assert {"LOST", "DROPPED"} <= setters.keys()  # the checker sees the calls


def test_reused_is_settled_natively_in_one_place():
    csrc = os.path.join(os.path.dirname(ROOT), "csrc")
    places = []
    for folder, _, files in os.walk(csrc):
        for file in files:
            if file.endswith((".cpp", ".h")):
                with open(os.path.join(folder, file)) as f:
                    text = f.read()
                places += [file] * len(re.findall(r"Settle(?:All)?\([^;]*Verdict::REUSED", text))
    assert places == ["commit.cpp"]


def test_one_module_binds_the_native_hooks():
    binds = _native_calls("bind")
    assert list(binds) == ["torch_xla_donate._hooks"]
    assert len(binds["torch_xla_donate._hooks"]) == 1
