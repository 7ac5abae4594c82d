"""The import layering of ``tandem/``, read from the source with ``ast``.

Every import statement counts: at module level, inside functions (lazy imports)
and under ``if TYPE_CHECKING:``. An edge goes from a module to the module an
import names: ``import a.b.c`` -> ``a.b.c``; ``from a.b import c`` -> ``a.b.c``
when ``c`` is a submodule, else ``a.b`` (its ``__init__``); relative imports are
resolved against the importing module's package. The parent packages Python
runs on the way (``a``, ``a.b``) are not edges: a package ``__init__`` that
imports its own submodules is the normal shape, while a submodule that imports
names from its package's ``__init__``, which imports it back, is a cycle.

The rules (docs/architecture.md, "Layout"; ARCHITECTURE.md "Model
capabilities": frontends and ``core/`` import no model):

(a) no import cycle between modules;
(b) ``tandem.core`` imports none of ``tandem.backends``, ``tandem.model_zoo``,
    ``tandem.registry``, ``tandem.entrypoints``, ``tandem.plugins``;
(c) ``tandem.entrypoints`` imports neither ``tandem.model_zoo`` nor
    ``tandem.audio``;
(d) inside ``tandem.core``, every module sits on a floor (``CORE_FLOORS``) and no
    import runs from a lower floor to a higher one (docs/architecture.md, "Floors
    inside core"); a new core module fails the test until it is given a floor.

``python tests/test_layering.py [TANDEM_DIR]`` prints, for a tree, its core modules
without a floor, the imports that run up a floor and the groups of core modules
that import each other in a loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tandem"

CORE_FORBIDDEN = ("tandem.backends", "tandem.model_zoo", "tandem.registry", "tandem.entrypoints", "tandem.plugins")
ENTRYPOINTS_FORBIDDEN = ("tandem.model_zoo", "tandem.audio")


# -- the graph ----------------------------------------------------------------------


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file for every ``.py`` under ``root`` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return files[name].name == "__init__.py"


def _known(name: str, files: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is a module of the tree."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in files:
            return candidate
    return None


def imports_of(name: str, files: dict[str, Path]) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement of module ``name`` that
    names a module of the tree (anywhere in the file: functions, TYPE_CHECKING blocks)."""
    tree = ast.parse(files[name].read_text(), filename=str(files[name]))
    package = name if _is_package(name, files) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, files)
                if target is not None:
                    out.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 > len(base_parts) - 1:
                    raise AssertionError(f"{files[name]}:{node.lineno}: relative import beyond the top package")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if _known(source, files) is None:
                continue  # not tandem's
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                target = sub if sub in files else _known(source, files)
                out.append((target, node.lineno))
    return out


def import_graph(files: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, self-imports left out."""
    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for m in files:
        for target, line in imports_of(m, files):
            if target != m:
                graph[m].setdefault(target, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    for root in graph:
        if root in index:
            continue
        # Iterative DFS: (node, iterator over its successors).
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, succ = work[-1]
            advanced = False
            for nxt in succ:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def cycles(graph: dict[str, dict[str, int]], limit: int = 200) -> list[list[str]]:
    """The elementary cycles (each as its modules, starting at its smallest name),
    at most ``limit`` of them."""
    found: list[list[str]] = []
    for comp in strongly_connected(graph):
        members = set(comp)
        for start in comp:  # cycles whose smallest module is ``start``
            allowed = {m for m in members if m >= start}
            path = [start]
            work = [iter(sorted(t for t in graph[start] if t in allowed))]
            on_path = {start}
            while work and len(found) < limit:
                nxt = next(work[-1], None)
                if nxt is None:
                    work.pop()
                    on_path.discard(path.pop())
                    continue
                if nxt == start:
                    found.append(list(path))
                elif nxt not in on_path:
                    path.append(nxt)
                    on_path.add(nxt)
                    work.append(iter(sorted(t for t in graph[nxt] if t in allowed)))
    return found


def forbidden_imports(graph, files, layer: str, forbidden: tuple[str, ...], root: Path = PACKAGE) -> list[str]:
    """``file:line: module imports target`` for each import from ``layer`` into ``forbidden``."""
    out = []
    for m, targets in graph.items():
        if m != layer and not m.startswith(layer + "."):
            continue
        for target, line in targets.items():
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                out.append(f"{files[m].relative_to(root.parent)}:{line}: {m} imports {target}")
    return sorted(out)


def _cycle_report(graph, files) -> list[str]:
    lines = []
    for cyc in cycles(graph):
        hops = []
        for a, b in zip(cyc, cyc[1:] + cyc[:1]):
            hops.append(f"{a} ({files[a].relative_to(PACKAGE.parent)}:{graph[a][b]})")
        lines.append(" -> ".join(hops + [cyc[0]]))
    return lines


# -- floors inside tandem.core -----------------------------------------------------------
# A module may import from its own floor or a lower one, never a higher one; inside a
# floor the no-cycle rule keeps the order. A key ending in ".*" is a package with all
# its modules; any other key is one module. Every module of tandem/core must match a
# key, and every key a module, so the table stays the map of core.
CORE_FLOORS: dict[str, tuple[int, str]] = {}
_FLOOR_NAMES = {
    1: "data: params, inputs, outputs, scheduler output, core outputs, sequence state, config",
    2: "kv: block pool, block manager, prefix and encoder caches, cache ops",
    3: "model interface, worker, strategies (each mode's per-request state and batch hooks)",
    4: "sched: the scheduler",
    5: "the engine core and the executors",
    6: "the frontend path inside core: LLMEngine, request processor, output processor, detokenizers",
}
for _floor, _keys in {
    1: ("tandem.core", "tandem.core.param_errors", "tandem.core.text_checks", "tandem.core.sampling_params",
        "tandem.core.structured_params", "tandem.core.schema_check", "tandem.core.speculative_config",
        "tandem.core.kv_compress_config", "tandem.core.generation_config", "tandem.core.inputs", "tandem.core.outputs", "tandem.core.core_outputs",
        "tandem.core.scheduler_output", "tandem.core.sequence", "tandem.core.config", "tandem.core.engine_args",
        "tandem.core.dtype", "tandem.core.checkpoint_source", "tandem.core.memory", "tandem.core.faults",
        "tandem.core.model_call", "tandem.core.vllm_prompts", "tandem.core.tokenizer_group"),
    2: ("tandem.core.kv.*",),
    3: ("tandem.core.attention", "tandem.core.relative_position", "tandem.core.layers.*", "tandem.core.model",
        "tandem.core.transcription", "tandem.core.weight_loading", "tandem.core.checkpoint", "tandem.core.loader",
        "tandem.core.worker.*", "tandem.core.strategies.*"),
    4: ("tandem.core.sched.*",),
    5: ("tandem.core.engine_core", "tandem.core.executor.*"),
    6: ("tandem.core.engine", "tandem.core.request_processor", "tandem.core.output_processor",
        "tandem.core.detokenizer"),
}.items():
    for _key in _keys:
        CORE_FLOORS[_key] = (_floor, _FLOOR_NAMES[_floor])


def floor_of(module: str, table: dict[str, tuple[int, str]] = CORE_FLOORS) -> int | None:
    """The floor of a core module by the table (an exact key first, then the
    innermost package key), or None when no key covers it."""
    if module in table:
        return table[module][0]
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i]) + ".*"
        if key in table:
            return table[key][0]
    return None


def core_without_floor(files, table=CORE_FLOORS) -> list[str]:
    return sorted(m for m in files if (m == "tandem.core" or m.startswith("tandem.core.")) and floor_of(m, table) is None)


def floor_keys_without_module(files, table=CORE_FLOORS) -> list[str]:
    out = []
    for key in table:
        if key.endswith(".*"):
            if key[:-2] not in files:
                out.append(key)
        elif key not in files:
            out.append(key)
    return sorted(out)


def upward_imports(graph, files, table=CORE_FLOORS, root: Path = PACKAGE) -> list[str]:
    """``file:line: module (floor a) imports target (floor b)`` for each core import with b > a."""
    out = []
    for m, targets in graph.items():
        low = floor_of(m, table)
        if low is None:
            continue
        for target, line in targets.items():
            high = floor_of(target, table)
            if high is not None and high > low:
                out.append(f"{files[m].relative_to(root.parent)}:{line}: {m} (floor {low}) imports {target} (floor {high})")
    return sorted(out)


def core_graph(graph) -> dict[str, dict[str, int]]:
    """The graph restricted to tandem.core's modules."""
    def inside(m):
        return m == "tandem.core" or m.startswith("tandem.core.")
    return {m: {t: line for t, line in ts.items() if inside(t)} for m, ts in graph.items() if inside(m)}


def core_units_graph(graph) -> dict[str, dict[str, int]]:
    """Core's graph with each of its files and packages as one node (``tandem.core.kv``
    stands for all of kv/): a feature package and the modules it imports must not
    import each other in a loop even when no two single modules do."""
    def unit(m):
        return ".".join(m.split(".")[:3])
    out: dict[str, dict[str, int]] = {}
    for m, targets in core_graph(graph).items():
        edges = out.setdefault(unit(m), {})
        for t, line in targets.items():
            if unit(t) != unit(m):
                edges.setdefault(unit(t), line)
    return out


@pytest.fixture(scope="module")
def tandem_graph():
    files = module_files(PACKAGE)
    return files, import_graph(files)


# -- the checker itself, on a package made for it --------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_every_kind_of_import_and_cycle(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.sub import thing\nfrom . import leaf\n",  # a package importing its own: normal
        "pkg/sub/__init__.py": "",
        "pkg/sub/thing.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from ..other import X\n"  # relative, two levels, TYPE_CHECKING
            "def f():\n    import pkg.leaf\n"  # lazy
        ),
        "pkg/other.py": "from pkg import sub\nfrom pkg.sub import thing as t\n",  # `from pkg import submodule`
        "pkg/leaf.py": "import os\n",
        "pkg/back.py": "from pkg import name_in_init\n",  # a name from the package's __init__
        "pkg/sub/loop.py": "from .thing import f\n",
    })
    files = module_files(tmp_path / "pkg")
    graph = import_graph(files)
    assert set(graph["pkg"]) == {"pkg.sub.thing", "pkg.leaf"}
    assert set(graph["pkg.sub.thing"]) == {"pkg.other", "pkg.leaf"}
    assert graph["pkg.sub.thing"]["pkg.other"] == 3  # the line of the import
    assert set(graph["pkg.other"]) == {"pkg.sub", "pkg.sub.thing"}
    assert set(graph["pkg.back"]) == {"pkg"}
    assert set(graph["pkg.sub.loop"]) == {"pkg.sub.thing"}
    assert graph["pkg.leaf"] == {}
    # thing -> other -> thing; the package __init__ importing submodules makes none.
    assert cycles(graph) == [["pkg.other", "pkg.sub.thing"]]

    # A submodule importing its package __init__, which imports it back, is one.
    _write(tmp_path, {"pkg/leaf.py": "from pkg import name_in_init\n"})
    graph = import_graph(module_files(tmp_path / "pkg"))
    assert ["pkg", "pkg.leaf"] in cycles(graph)
    assert ["pkg", "pkg.sub.thing", "pkg.leaf"] in cycles(graph)


def test_the_checker_finds_forbidden_imports_inside_functions(tmp_path):
    _write(tmp_path, {
        "tandem/__init__.py": "",
        "tandem/core/__init__.py": "",
        "tandem/core/engine.py": "def load():\n    from tandem.registry import models\n",
        "tandem/registry/__init__.py": "",
        "tandem/registry/models.py": "",
    })
    files = module_files(tmp_path / "tandem")
    got = forbidden_imports(import_graph(files), files, "tandem.core", CORE_FORBIDDEN, root=tmp_path / "tandem")
    assert got == ["tandem/core/engine.py:2: tandem.core.engine imports tandem.registry.models"]


def test_the_graph_of_tandem_is_read(tandem_graph):
    """Edges of today's tree, so a parser that reads nothing cannot pass the rules
    below (the kinds of import are covered by the package made above)."""
    files, graph = tandem_graph
    assert len(files) > 50
    assert "tandem.core.engine" in graph["tandem"]  # the top package's own re-exports
    assert "tandem.core.worker.warpers" in graph["tandem.core.worker.sampler"]
    assert sum(len(t) for t in graph.values()) > 100


# -- the rules ---------------------------------------------------------------------------


def test_no_import_cycles(tandem_graph):
    files, graph = tandem_graph
    report = _cycle_report(graph, files)
    comps = strongly_connected(graph)
    assert not report, (
        f"{len(report)} import cycles (in {len(comps)} groups of modules that import each other: "
        + "; ".join(", ".join(c) for c in comps) + "):\n" + "\n".join(report)
    )


def test_core_imports_no_backend_model_registry_plugin_or_frontend(tandem_graph):
    files, graph = tandem_graph
    bad = forbidden_imports(graph, files, "tandem.core", CORE_FORBIDDEN)
    assert not bad, f"{len(bad)} imports from tandem.core into {', '.join(CORE_FORBIDDEN)}:\n" + "\n".join(bad)


def test_entrypoints_import_no_model_and_no_audio_code(tandem_graph):
    files, graph = tandem_graph
    bad = forbidden_imports(graph, files, "tandem.entrypoints", ENTRYPOINTS_FORBIDDEN)
    into = ", ".join(ENTRYPOINTS_FORBIDDEN)
    assert not bad, f"{len(bad)} imports from tandem.entrypoints into {into}:\n" + "\n".join(bad)


# -- no mode named in the core's mode-agnostic files -----------------------------------
# The scheduler, engine core, sequence, kv/, worker/ and the output processor (which
# follows each request's declared OutputShape) call the modes' hooks only
# (docs/architecture.md, "Adding a mode"): a name in their code (not comments or
# docstrings) that names a mode means a mode leaked into them.
MODE_AGNOSTIC = ("core/sched", "core/engine_core.py", "core/sequence.py", "core/kv", "core/worker",
                 "core/output_processor.py")
MODE_WORDS = ("spec_token", "speculat", "draft", "beam", "grammar", "structured", "bitmask", "prompt_slot",
              "promptslot", "xgrammar")


def _code_names(path: Path) -> list[tuple[int, str]]:
    """Identifiers and attribute names of ``path``'s code, with their lines."""
    import io
    import tokenize

    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME:
            out.append((tok.start[0], tok.string))
    return out


def test_mode_agnostic_files_name_no_mode():
    found = []
    for rel in MODE_AGNOSTIC:
        root = PACKAGE / rel
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            for line, name in _code_names(path):
                if any(w in name.lower() for w in MODE_WORDS):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
    assert not found, "mode names in mode-agnostic code:\n" + "\n".join(found)



# -- floors inside core ----------------------------------------------------------------------


def test_the_floor_checker_finds_upward_imports_and_unassigned_modules(tmp_path):
    _write(tmp_path, {
        "tandem/__init__.py": "",
        "tandem/core/__init__.py": "",
        "tandem/core/params.py": "def f():\n    from tandem.core.sched.scheduler import S\n",  # lazy, up two floors
        "tandem/core/sched/__init__.py": "",
        "tandem/core/sched/scheduler.py": "from tandem.core import params\n",  # down: allowed
        "tandem/core/kv/__init__.py": "",
        "tandem/core/kv/pool.py": "from tandem.core.kv import new_thing\n",  # its own floor: allowed
        "tandem/core/kv/new_thing.py": "",
        "tandem/core/stray.py": "",
    })
    table = {"tandem.core": (1, ""), "tandem.core.params": (1, ""), "tandem.core.kv.*": (2, ""),
             "tandem.core.sched.*": (4, ""), "tandem.core.gone": (1, "")}
    files = module_files(tmp_path / "tandem")
    graph = import_graph(files)
    assert floor_of("tandem.core.kv.new_thing", table) == 2
    assert floor_of("tandem.core.kv", table) == 2
    assert upward_imports(graph, files, table, root=tmp_path / "tandem") == [
        "tandem/core/params.py:2: tandem.core.params (floor 1) imports tandem.core.sched.scheduler (floor 4)"]
    assert core_without_floor(files, table) == ["tandem.core.stray"]
    assert floor_keys_without_module(files, table) == ["tandem.core.gone"]


def test_every_core_module_has_a_floor(tandem_graph):
    files, _ = tandem_graph
    missing = core_without_floor(files)
    assert not missing, ("core modules without a floor (give each one in CORE_FLOORS, "
                         "and a line in docs/architecture.md): " + ", ".join(missing))
    stale = floor_keys_without_module(files)
    assert not stale, "CORE_FLOORS names modules that do not exist: " + ", ".join(stale)


def test_no_core_import_runs_up_a_floor(tandem_graph):
    files, graph = tandem_graph
    bad = upward_imports(graph, files)
    assert not bad, f"{len(bad)} imports run up a floor of tandem.core:\n" + "\n".join(bad)


def test_no_cycle_inside_core(tandem_graph):
    files, graph = tandem_graph
    comps = strongly_connected(core_graph(graph))
    assert not comps, "core modules importing each other in a loop: " + "; ".join(", ".join(c) for c in comps)


def test_no_loop_among_cores_files_and_packages(tandem_graph):
    _, graph = tandem_graph
    units = core_units_graph(graph)
    comps = strongly_connected(units)
    assert not comps, (f"core's files and packages importing each other in a loop (of {len(units)}): "
                       + "; ".join(", ".join(c) for c in comps))


def test_the_unit_graph_joins_a_package(tmp_path):
    _write(tmp_path, {
        "tandem/__init__.py": "",
        "tandem/core/__init__.py": "",
        "tandem/core/model.py": "from tandem.core.feature import mode\n",
        "tandem/core/feature/__init__.py": "",
        "tandem/core/feature/mode.py": "",
        "tandem/core/feature/loader.py": "from tandem.core import model\n",
    })
    graph = import_graph(module_files(tmp_path / "tandem"))
    assert strongly_connected(core_graph(graph)) == []  # no loop between single modules
    assert strongly_connected(core_units_graph(graph)) == [["tandem.core.feature", "tandem.core.model"]]


def test_no_core_module_only_re_exports(tandem_graph):
    """No shims: a core module whose body is only imports (and ``__all__``) re-exports
    another's names; import them from where they live. ``tandem.core.layers`` is the
    exception: the building blocks model authors import (docs/adding_a_model.md)."""
    files, _ = tandem_graph
    shims = []
    for m, path in files.items():
        if not m.startswith("tandem.core.") or m == "tandem.core.layers":
            continue
        body = [n for n in ast.parse(path.read_text()).body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]  # docstring
        imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))
                   and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
        rest = [n for n in body if n not in imports and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
                and not (isinstance(n, ast.Assign) and [getattr(x, "id", None) for x in n.targets] == ["__all__"])]
        if imports and not rest:
            shims.append(f"{path.relative_to(PACKAGE.parent)}")
    assert not shims, "modules that only re-export others' names: " + ", ".join(sorted(shims))


def _report(root: Path) -> None:
    files = module_files(root)
    graph = import_graph(files)
    print("core modules without a floor:", ", ".join(core_without_floor(files)) or "none")
    up = upward_imports(graph, files, root=root)
    print(f"{len(up)} imports up a floor:")
    for line in up:
        print("  " + line)
    core = [m for m in files if m == "tandem.core" or m.startswith("tandem.core.")]
    comps = strongly_connected(core_graph(graph))
    print(f"{len(comps)} loops among core's {len(core)} modules:")
    for c in comps:
        print(f"  {len(c)}: " + ", ".join(c))
    units = core_units_graph(graph)
    comps = strongly_connected(units)
    print(f"{len(comps)} loops among core's {len(units)} files and packages:")
    for c in comps:
        print(f"  {len(c)}: " + ", ".join(c))


if __name__ == "__main__":
    import sys

    _report(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PACKAGE)
