"""What the plugin-facing interface imports: a backend plugin's ``from tandem import
AttentionBackend`` (and ``import tandem.core.attention``) must not start the engine's
machinery, the model libraries or any kernel package."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tandem

# Stateful engine parts and heavy libraries the interface does not need.
HEAVY = (
    "tandem.core.engine",
    "tandem.core.scheduler",
    "tandem.core.sequence",
    "tandem.core.block_manager",
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


def test_every_public_name_resolves_to_its_defining_module():
    for name in tandem.__all__:
        value = getattr(tandem, name)
        module = tandem._LAZY[name]
        assert value is getattr(sys.modules[module], name), name
    assert set(tandem.__all__) == set(tandem._LAZY)
    with pytest.raises(AttributeError, match="module 'tandem' has no attribute 'NoSuchThing'"):
        tandem.NoSuchThing  # noqa: B018
