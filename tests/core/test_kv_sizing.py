"""The KV pools are sized across the ranks: every rank allocates the same block ids, as
many as the tightest rank holds, and ranks on one machine share its RAM."""

from types import SimpleNamespace

import pytest

from tandem.core.executor.kv_sizing import RankMemory, size_kv_pools

GiB = 1 << 30


class _Model:
    @staticmethod
    def max_encoder_len(cfg):
        return 64

    @staticmethod
    def max_decoder_len(cfg):
        return 32


def _config(**kw):
    base = dict(num_kv_blocks=None, kv_cache_memory=None, swap_space=0.0, block_size=16, max_num_seqs=4)
    return SimpleNamespace(**{**base, **kw})


def _rank(rank, block_bytes, free=64 * GiB, device="cpu", host="a", host_free=64 * GiB):
    return RankMemory(rank, device, block_bytes, free, host, host_free)


def test_the_block_count_is_the_least_any_rank_holds():
    # kv_cache_memory is GiB per rank: a rank with bigger blocks (replicated KV heads) holds fewer.
    cfg = _config(kv_cache_memory=1.0, swap_space=0.5)
    reports = [_rank(0, 1 << 20, device="cuda:0"), _rank(1, 4 << 20, device="cuda:1")]
    assert size_kv_pools(cfg, _Model, None, reports) == (GiB // (4 << 20), GiB // 2 // (4 << 20))


def test_the_default_is_what_max_num_seqs_full_requests_need():
    # 4 requests x (64 / 16 encoder + 32 / 16 decoder blocks) x 1.02, + 1
    cfg = _config()
    assert size_kv_pools(cfg, _Model, None, [_rank(0, 1024), _rank(1, 1024)])[0] == int(4 * 6 * 1.02) + 1


def test_cpu_ranks_on_one_machine_count_their_pools_together():
    cfg = _config(num_kv_blocks=100, swap_space=0.0)
    ranks = [_rank(r, 1 << 20, free=150 << 20, host_free=150 << 20) for r in range(2)]  # 100 MiB each, 150 free
    with pytest.raises(ValueError, match=r"num_kv_blocks=100.* on each of 2 ranks needs 0.20 GiB but this machine's "
                                         r"RAM has 0.15 GiB available"):
        size_kv_pools(cfg, _Model, None, ranks)
    # on two machines each has room for its own
    apart = [_rank(r, 1 << 20, free=150 << 20, host=f"h{r}", host_free=150 << 20) for r in range(2)]
    assert size_kv_pools(cfg, _Model, None, apart) == (100, 0)


def test_a_gpu_without_room_is_named():
    cfg = _config(num_kv_blocks=100)
    ranks = [_rank(0, 1 << 20, device="cuda:0"), _rank(1, 1 << 20, free=50 << 20, device="cuda:1")]
    with pytest.raises(ValueError, match=r"needs 0.10 GiB but cuda:1 \(rank 1\) has 0.05 GiB available"):
        size_kv_pools(cfg, _Model, None, ranks)
