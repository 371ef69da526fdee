"""kvobs' modules import each other without a cycle: data flows one way (sources ->
correlate -> verdicts -> fleet/render), and a function-local import cannot hide a cycle
because every import statement counts, wherever it sits (only ``if TYPE_CHECKING:``
blocks, never executed, are left out). The public API (``PUBLIC_MODULES``: what README.md
and docs/ import or name in vLLM's config) declares itself in ``__all__``, and every name
there exists."""

import ast
import importlib
import importlib.util
import os
import re

import pytest

import kvobs

ROOT = os.path.dirname(os.path.abspath(kvobs.__file__))


def _module_name(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(ROOT))[:-len(".py")].split(os.sep)
    return ".".join(relative[:-1] if relative[-1] == "__init__" else relative)


def _modules() -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                found[_module_name(path)] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body
                           for child in ast.walk(statement))
    return skipped


def imports_of(module: str, path: str, modules: dict[str, str]) -> set[str]:
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    skipped = _type_checking_only(tree)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else base)
    return {t for t in targets if t in modules and t != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_in_kvobs():
    assert cycles(import_graph()) == []


def test_the_checker_finds_a_cycle_through_a_function_local_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from kvobs.sources import store\n")
    modules = {"kvobs.sources": "", "kvobs.sources.store": "", "kvobs.x": ""}
    assert imports_of("kvobs.x", str(source), modules) == {"kvobs.sources.store"}


# The public API: what README.md and docs/ tell users to import or name in a config.
PUBLIC_MODULES = (
    "kvobs",
    "kvobs.diagnose",
    "kvobs.semconv",
    "kvobs.settings",
    "kvobs.sources",
    "kvobs.proxy",
    "kvobs.monitoring",
    "kvobs.monitoring.live",
    "kvobs.fleet",
    "kvobs.verdicts",
    "kvobs.synth",
    "connector_instrumented",
    "connector_instrumented.offloading",
    "connector_instrumented.host_copy",
)
REPOSITORY = os.path.dirname(ROOT)
_DOCUMENTED_IMPORT = re.compile(
    r"^\s*from ((?:kvobs|connector_instrumented)[\w.]*) import ([\w, ]+)$", re.M)
# vLLM's kv_transfer_config names a class and the module it is in, twice in the docs'
# configs: the connector (kv_connector) and the offloading spec (spec_name).
_DOCUMENTED_CLASS = re.compile(
    r'"(?:kv_connector|spec_name)": "(\w+)",\s*"(?:kv_connector_module_path|spec_module_path)":'
    r' "([\w.]+)"')


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def _documented_imports() -> list[tuple[str, str, str]]:
    """(document, module, name) of every ``from kvobs... import name`` in README/docs."""
    return [(document, module_name, name.strip())
            for document, text in _documents().items()
            for module_name, names in _DOCUMENTED_IMPORT.findall(text)
            for name in names.split(",")]


def _documents() -> dict[str, str]:
    paths = [os.path.join(REPOSITORY, "README.md")]
    docs = os.path.join(REPOSITORY, "docs")
    paths += [os.path.join(docs, name) for name in sorted(os.listdir(docs))
              if name.endswith(".md")]
    out = {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            out[os.path.relpath(path, REPOSITORY)] = handle.read()
    return out


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_name_exists(name):
    module = importlib.import_module(name)
    exported = module.__all__
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    missing = [n for n in exported if not hasattr(module, n)]
    assert missing == [], f"{name}.__all__ names what it lacks: {missing}"
    private = [n for n in exported if n.startswith("_") and not n.startswith("__")]
    assert private == [], f"{name}.__all__ exports private names: {private}"


def test_documented_imports_are_public_names():
    imports = _documented_imports()
    assert len(imports) >= 6  # docs/proxy.md's five, dashboards.md's one: the docs are read
    for document, module_name, name in imports:
        if _is_module(f"{module_name}.{name}"):  # `from kvobs.monitoring import live`
            assert f"{module_name}.{name}" in PUBLIC_MODULES, (
                f"{document} imports module {module_name}.{name}: list it as public")
        else:
            assert name in importlib.import_module(module_name).__all__, (
                f"{document}: `from {module_name} import {name}`: not in its __all__")


def test_classes_the_vllm_configs_name_are_public():
    found = []
    for document, text in _documents().items():
        for class_name, module_name in _DOCUMENTED_CLASS.findall(text):
            found.append(class_name)
            module = importlib.import_module(module_name)
            assert class_name in module.__all__, f"{document}: {module_name}.{class_name}"
    assert {"KvobsNixlConnector", "KvobsOffloadingConnector", "KvobsHostCopySpec"} <= set(found)


def test_semconv_exports_what_it_defines_not_what_it_imports():
    from kvobs import semconv

    assert {"SPAN_PROXY_TURN", "Verdict", "Attribute", "turn_bucket"} <= set(semconv.__all__)
    assert not {"enum", "dataclass", "annotations"} & set(semconv.__all__)
