"""The out-of-tree ``tandem-example-backend`` package: installed with pip, found
through its entry point, never chosen automatically, conformant (float64
reference on random paged layouts in its own block-major layout), and BART
through it equal to torch_sdpa token for token."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from layouts import MIXES, check_backend  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402
from tandem.core.attention import AttentionType  # noqa: E402
from tandem.plugins import default_backend_registry, plugin_manager, reset_registries  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "tandem-example-backend"
CPU = torch.device("cpu")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _forget_plugin() -> None:
    reset_registries()
    importlib.invalidate_caches()
    for name in [m for m in sys.modules if m.split(".")[0] == "tandem_example_backend"]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    # Build from a copy so setuptools' build/ and *.egg-info never land in the source tree.
    src = tmp_path_factory.mktemp("pkg") / "tandem-example-backend"
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    _pip("install", "--no-deps", "--no-build-isolation", "-q", str(src))
    _forget_plugin()
    try:
        yield default_backend_registry().load("example_paged")
    finally:
        _pip("uninstall", "-y", "-q", "tandem-example-backend")
        _forget_plugin()


def test_registered_by_its_plugin_and_never_chosen_automatically(backend):
    info = plugin_manager().plugins["tandem-example-backend"]
    assert info.backends == ["example_paged"] and info.distribution == "tandem-example-backend"
    assert default_backend_registry().owner("example_paged") == "tandem-example-backend"
    assert backend.__module__ == "tandem_example_backend.backend"
    selection = default_backend_registry().select(None, device=CPU, dtype=torch.float32, head_size=8,
                                                  attn_types=frozenset(AttentionType), block_size=16)
    assert selection.backend.name in ("cpu_paged", "torch_sdpa")
    assert "example_paged: chosen only when asked for by name" in selection.reason


@pytest.mark.parametrize("heads", [(4, 8), (2, 8), (1, 64)], ids=["mha", "gqa", "mqa-d64"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mix", list(MIXES))
def test_conformance_in_its_own_layout(backend, heads, block_size, mix):
    for seed in range(2):
        check_backend(backend, seed, block_size, heads[0], heads[1], mix)


def test_its_layout_is_block_major_and_swap_copy_move_whole_blocks(backend):
    cache = backend.allocate_kv_cache(6, 4, 2, 8, torch.float32, CPU)
    assert cache.shape == (6, 2, 2, 4, 8) and backend.kv_cache_block_dim == 0
    g = torch.Generator().manual_seed(0)
    cache.copy_(torch.randn(cache.shape, generator=g))
    before = cache.clone()
    host = backend.allocate_kv_cache(3, 4, 2, 8, torch.float32, "cpu", zeroed=False)
    backend.swap_blocks(cache, host, torch.tensor([5, 1]), torch.tensor([0, 2]))
    assert torch.equal(host[0], before[5]) and torch.equal(host[2], before[1])
    backend.copy_blocks([cache], torch.tensor([2]), torch.tensor([4]))
    assert torch.equal(cache[4], before[2])
    assert all(torch.equal(cache[i], before[i]) for i in range(6) if i != 4)


def test_the_operator_has_a_consistent_fake_for_torch_compile(backend):
    from tandem_example_backend.kernel import paged_attention

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 4, 8, generator=g), torch.randn(5, 2, 2, 4, 8, generator=g),
            torch.tensor([[3, 1], [0, 4]]), torch.tensor([0, 0, 1]), torch.tensor([4, 5, 2]),
            torch.tensor([6, 3]), 0.35, True)
    torch.library.opcheck(paged_attention, args, test_utils=("test_schema", "test_faketensor"))


def test_bart_through_it_equals_torch_sdpa(backend, bart_dir):
    prompts = [{"prompt_token_ids": [0, *range(5, 5 + n), 2]} for n in (1, 9, 23, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)

    def run(name):
        llm = LLM(model=str(bart_dir), dtype="float32", attention_backend=name, block_size=4)
        assert llm.engine.attn_backend.name == name
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run("example_paged") == run("torch_sdpa")
