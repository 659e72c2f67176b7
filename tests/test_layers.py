"""The source tree keeps its layers (DESIGN §4): imports and includes run one
way. flashqla/: the public API (_api.py) and the framework front-ends call
down into the prepared-call layer (_prepared.py, _frameworks.py, _C), never
back up. csrc/python/: the binding's files include each other without a
circle."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "flashqla")
BINDING = os.path.join(ROOT, "csrc", "python")

# module -> the flashqla modules it may import (directly or lazily)
ALLOWED = {
    "_typing": set(),
    "_frameworks": {"_C"},
    "_prepared": {"_C", "_frameworks", "_typing"},
    "_torch": {"_C", "_frameworks", "_prepared", "_typing"},
    "jax": {"_C", "_frameworks", "_prepared", "_typing"},
    "distributed": {"_C", "_frameworks", "_prepared", "_typing"},
    "reference": set(),
}


def _flashqla_imports(path):
    """The flashqla submodules a file imports (relative or absolute), lazily or not."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name.split(".")[0] for a in node.names)
            elif node.module and node.module.split(".")[0] == "flashqla":
                parts = node.module.split(".")
                if len(parts) > 1:
                    found.add(parts[1])
                else:
                    found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "flashqla" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_python_layers_import_downwards_only():
    for mod, allowed in ALLOWED.items():
        path = os.path.join(PKG, mod + ".py")
        if not os.path.exists(path):
            continue
        extra = _flashqla_imports(path) - allowed
        assert not extra, f"flashqla/{mod}.py imports {sorted(extra)}, above its layer"


def _includes(path):
    return re.findall(r'^#include "([^"]+)"', open(path, encoding="utf-8").read(), flags=re.M)


def test_binding_includes_have_no_circle():
    files = sorted(os.listdir(BINDING))
    local = {f for f in files if f.endswith(".h")}
    # a .c file stands for its own header: x.c includes y.h  =>  x -> y
    graph = {}
    for f in files:
        if not f.endswith((".c", ".h")):
            continue
        node = os.path.splitext(f)[0]
        graph.setdefault(node, set()).update(
            os.path.splitext(h)[0] for h in _includes(os.path.join(BINDING, f))
            if h in local and os.path.splitext(h)[0] != node)
    state = {}

    def visit(n, path):
        if state.get(n) == "done":
            return
        assert state.get(n) != "open", "include circle in csrc/python: " + " -> ".join(path + [n])
        state[n] = "open"
        for m in sorted(graph.get(n, ())):
            visit(m, path + [n])
        state[n] = "done"

    for n in sorted(graph):
        visit(n, [])
    assert {"errors", "dlpack_import", "validate", "module"} <= set(graph)


_NOT_SOURCE = {"build", "dist", "__pycache__", "venv", "node_modules"}


def _source_dirs():
    """Every folder of the source tree down to two levels (relative, '/'-joined;
    deeper ones belong to their parent's entry), build outputs and hidden
    folders (but .ci) left out."""
    found = set()
    for dirpath, dirnames, _ in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        dirnames[:] = [d for d in dirnames
                       if d not in _NOT_SOURCE and not d.endswith(".egg-info")
                       and (not d.startswith(".") or (rel == "." and d == ".ci"))]
        if rel != "." and rel.count(os.sep) < 2:
            found.add(rel.replace(os.sep, "/"))
    return found


def _readme_layout():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed, stack = set(), []
    for line in block.splitlines():
        m = re.match(r"^( +)(\S+)", line)
        if not m or not (m.group(2).endswith("/") or m.group(2) == ".ci/run"):
            continue
        indent, name = len(m.group(1)), m.group(2).rstrip("/")
        if name == ".ci/run":
            name = ".ci"
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([p for _, p in stack] + [name])
        listed.add(path)
        stack.append((indent, name))
    return listed


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "README.md")),
                    reason="README.md not beside tests/ (an installed copy of the tests)")
def test_readme_layout_lists_every_folder():
    missing = sorted(_source_dirs() - _readme_layout())
    assert not missing, f"README.md's Layout does not list: {missing}"


def test_every_public_function_documents_its_input_shapes():
    import flashqla
    from flashqla import reference
    fns = [getattr(flashqla, n) for n in flashqla.__all__
           if callable(getattr(flashqla, n)) and not isinstance(getattr(flashqla, n), type)]
    fns += [reference.forward, reference.backward, reference.recurrent]
    try:
        import flashqla.jax as fqj
        fns += [getattr(fqj, n) for n in fqj.__all__]
    except ImportError:
        pass
    for fn in fns:
        doc = fn.__doc__ or ""
        for shape in ("[B, T, H, K]", "[B, T, HV, V]", "[B, T, HV]"):
            assert shape in doc, f"{fn.__module__}.{fn.__name__}: docstring lacks {shape}"
