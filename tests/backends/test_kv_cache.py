"""The shared KV-cache ops: scatter by slot, gather by block table."""

import torch

from tandem.core.kv.cache_ops import GatherWorkspace, gather_from_paged_cache, write_to_paged_cache


def test_write_then_gather_returns_each_sequence_in_order():
    g = torch.Generator().manual_seed(0)
    bs, H, D, num_blocks = 4, 2, 3, 12
    cache = torch.zeros(2, num_blocks, bs, H, D)
    tables = torch.tensor([[7, 2, 9], [0, 11, 5]])
    lens = [10, 6]
    keys = [torch.randn(n, H, D, generator=g) for n in lens]
    values = [torch.randn(n, H, D, generator=g) for n in lens]
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i, pos // bs] * bs + pos % bs
        write_to_paged_cache(keys[i], values[i], cache, slots)
    ws = GatherWorkspace()
    for workspace in (None, ws):
        k, v = gather_from_paged_cache(cache, tables, workspace)
        assert k.shape == (2, 12, H, D)
        for i, n in enumerate(lens):
            torch.testing.assert_close(k[i, :n], keys[i], rtol=0, atol=0)
            torch.testing.assert_close(v[i, :n], values[i], rtol=0, atol=0)


def test_workspace_reuses_its_buffer_and_grows():
    cache = torch.randn(2, 8, 4, 2, 3)
    ws = GatherWorkspace()
    k1, _ = gather_from_paged_cache(cache, torch.tensor([[1, 2]]), ws)
    ptr = k1.data_ptr()
    k2, _ = gather_from_paged_cache(cache, torch.tensor([[3], [4]]), ws)
    assert k2.data_ptr() == ptr  # same storage, no new allocation
    k3, _ = gather_from_paged_cache(cache, torch.tensor([[0, 1, 2, 3, 4, 5]]), ws)
    torch.testing.assert_close(k3[0].view(6, 4, 2, 3), cache[0, :6])
