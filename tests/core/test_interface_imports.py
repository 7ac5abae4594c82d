"""What the plugin-facing interface imports: a backend plugin's ``from tandem import
AttentionBackend`` (and ``import tandem.core.attention``) must not start the engine's
machinery, the model libraries or any kernel package."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import tandem

# Stateful engine parts and heavy libraries the interface does not need.
HEAVY = (
    "tandem.core.engine",
    "tandem.core.sched.scheduler",
    "tandem.core.sequence",
    "tandem.core.kv.block_manager",
    "tandem.core.kv.block_pool",
    "tandem.core.worker",
    "tandem.core.worker.sampler",
    "tandem.core.worker.model_runner",
    "tandem.entrypoints.llm",
    "tandem.plugins.manager",
    "tandem.registry.backends",
    "transformers",
    "triton",
    "xformers",
    "flash_attn",
)


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.mark.parametrize("statement", [
    "import tandem.core.attention",
    "import tandem",
    "from tandem import AttentionBackend, AttentionImpl, AttentionMetadata, AttentionMetadataBuilder, "
    "AttentionType, BackendCapabilities, SizeRule, StepInputs",
])
def test_the_backend_interface_imports_no_engine_state_and_no_heavy_library(statement):
    loaded = set(_loaded_after(statement))
    assert [m for m in HEAVY if m in loaded] == []
    # The interface is a handful of modules, not the engine.
    assert len([m for m in loaded if m.split(".")[0] == "tandem"]) <= 8, sorted(loaded)


def _defined_at_top_level() -> dict[str, list[str]]:
    """Name -> the modules of ``tandem/`` (not its ``__init__``) whose source defines it at top
    level (class, def or assignment), read with ``ast``: an oracle apart from ``tandem._LAZY``."""
    root = Path(tandem.__file__).parent
    out: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path == root / "__init__.py":
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                names = []
            for name in names:
                out.setdefault(name, []).append(module)
    return out


def test_every_public_name_resolves_to_its_defining_module():
    defined = _defined_at_top_level()
    for name in tandem.__all__:
        assert len(defined.get(name, [])) == 1, f"{name}: defined in {defined.get(name)}, expected one module"
        module = defined[name][0]
        assert getattr(tandem, name) is getattr(importlib.import_module(module), name), (name, module)
    assert set(tandem.__all__) == set(tandem._LAZY)
    with pytest.raises(AttributeError, match="module 'tandem' has no attribute 'NoSuchThing'"):
        tandem.NoSuchThing  # noqa: B018
