"""Every registered attention backend against float64 on the same random paged
layouts, the cache it wrote against the new K/V, and its KV-cache ops (allocate,
swap, copy) against exact expectations."""

from __future__ import annotations

import pytest
import torch

from layouts import D, MIXES, check_backend
from tandem.core.attention import AttentionType
from tandem.plugins import default_backend_registry

CPU = torch.device("cpu")


# Backends whose kernels refuse the CPU: here they could only ever skip. Their own
# files run check_backend on these layouts through a float64 reference of the
# kernel's contract on CPU, and the real kernels on CUDA (-m gpu).
CHECKED_IN_THEIR_OWN_FILES = {"xformers": "test_xformers.py", "flash_attn": "test_flash_attn.py"}


def _serves_cpu(name) -> bool:
    backend = default_backend_registry().load(name)
    return not backend.unsupported_reasons(CPU, torch.float32, D, frozenset(AttentionType), 16, torch.float32)


def _backends():
    reg = default_backend_registry()
    return [pytest.param(name, id=name) for name in reg.names() if name not in CHECKED_IN_THEIR_OWN_FILES]


def _load(name, head_size=D, block_size=16, dtype=torch.float32):
    backend = default_backend_registry().load(name)
    reasons = backend.unsupported_reasons(CPU, dtype, head_size, frozenset(AttentionType), block_size, dtype)
    if reasons:
        pytest.skip(f"{name} cannot run on cpu/{dtype}: {'; '.join(reasons)}")
    return backend


def test_tandem_registers_at_least_its_own_backend():
    assert "torch_sdpa" in default_backend_registry().names()


def test_the_backends_left_out_refuse_the_cpu_and_have_their_own_checks():
    from pathlib import Path

    names = default_backend_registry().names()
    for name, test_file in CHECKED_IN_THEIR_OWN_FILES.items():
        assert name in names and not _serves_cpu(name), name
        assert "check_backend(" in (Path(__file__).parent / test_file).read_text(), test_file


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("heads", [(4, 8), (2, 8), (1, 64)], ids=["mha", "gqa", "mqa-d64"])  # (num_kv_heads, D)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("seed", range(2))
def test_three_attention_kinds_match_float64_and_write_their_cache(name, heads, block_size, mix, seed):
    num_kv_heads, head_size = heads
    check_backend(_load(name, head_size, block_size), seed, block_size, num_kv_heads, head_size, mix)


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seed", range(2))
def test_bfloat16_within_its_measured_tolerance(name, block_size, seed):
    check_backend(_load(name, 64, block_size, torch.bfloat16), seed, block_size, 2, 64, "mixed", dtype=torch.bfloat16)


def _serves_bias(name) -> None:
    reasons = default_backend_registry().load(name).feature_reasons(frozenset({"relative_position_bias"}))
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("heads", [(4, 8), (1, 64)], ids=["mha", "mqa-d64"])  # (num_kv_heads, D)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("seed", range(2))
def test_relative_position_bias_matches_float64(name, heads, block_size, mix, seed):
    """Backends that declare the feature: T5's bucketed bias, bidirectional over encoder runs,
    causal over prefills, chunks and decodes from the paged cache, none in cross attention."""
    _serves_bias(name)
    num_kv_heads, head_size = heads
    check_backend(_load(name, head_size, block_size), seed, block_size, num_kv_heads, head_size, mix, bias=True)


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("seed", range(2))
def test_relative_position_bias_bfloat16(name, seed):
    _serves_bias(name)
    check_backend(_load(name, 64, 16, torch.bfloat16), seed, 16, 2, 64, "mixed", dtype=torch.bfloat16, bias=True)


@pytest.mark.parametrize("name", default_backend_registry().names())
def test_swap_and_copy_move_exactly_the_listed_blocks(name):
    # The cache ops are torch indexing on any device: checked on CPU for every backend,
    # those whose kernels refuse the CPU included.
    backend = default_backend_registry().load(name)
    g = torch.Generator().manual_seed(0)
    dim = backend.kv_cache_block_dim
    dev = [backend.allocate_kv_cache(10, 4, 2, D, torch.float32, CPU) for _ in range(2)]
    for cache in dev:
        cache.copy_(torch.randn(cache.shape, generator=g))
    host = [backend.allocate_kv_cache(6, 4, 2, D, torch.float32, "cpu", zeroed=False) for _ in range(2)]
    before = [c.clone() for c in dev]

    def block(t, i):
        return t.select(dim, i)

    backend.swap_blocks(dev[0], host[0], torch.tensor([7, 2]), torch.tensor([0, 5]))
    assert torch.equal(block(host[0], 0), block(before[0], 7)) and torch.equal(block(host[0], 5), block(before[0], 2))
    backend.swap_blocks(host[0], dev[1], torch.tensor([5]), torch.tensor([9]))
    assert torch.equal(block(dev[1], 9), block(before[0], 2))
    untouched = [i for i in range(10) if i != 9]
    assert all(torch.equal(block(dev[1], i), block(before[1], i)) for i in untouched)
    # Copy-on-write in every layer; a destination that is another pair's source is read first.
    snap = [c.clone() for c in dev]
    backend.copy_blocks(dev, torch.tensor([1, 3]), torch.tensor([3, 4]))
    for layer, s in zip(dev, snap):
        assert torch.equal(block(layer, 3), block(s, 1)) and torch.equal(block(layer, 4), block(s, 3))
        assert all(torch.equal(block(layer, i), block(s, i)) for i in range(10) if i not in (3, 4))


@pytest.mark.slow
def test_choosing_a_backend_imports_no_kernel_package():
    """Every backend module loads for the automatic choice and `tandem plugins`; none
    may import its kernel package (triton, xformers, flash_attn) to do so."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from tandem.plugins import default_backend_registry\n"
        "from tandem.core.attention import AttentionType\n"
        "reg = default_backend_registry()\n"
        "sel = reg.select(None, device=torch.device('cpu'), dtype=torch.float32, head_size=64,\n"
        "                 attn_types=frozenset(AttentionType), block_size=16)\n"
        "for name in reg.names():\n"
        "    b = reg.load(name)\n"
        "    b.unsupported_reasons(torch.device('cuda'), torch.bfloat16, 64, frozenset(AttentionType), 16,\n"
        "                          torch.bfloat16)\n"
        "print(sel.backend.name, sorted(m for m in ('triton', 'xformers', 'flash_attn') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    from tandem.backends.cpu_paged import ops

    # cpu_paged ranks above torch_sdpa on CPU wherever its C++ op builds (tools present and
    # the build for this CPU's variant works).
    expected = "cpu_paged" if ops.available() else "torch_sdpa"
    assert out.split()[0] == expected and out.strip().endswith("[]"), out
