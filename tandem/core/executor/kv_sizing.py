"""How many KV blocks each rank's pool holds, sized together across the ranks.

Every rank holds its heads' share of each block, so one block costs
``block_bytes / tensor_parallel_size`` per rank (more where KV heads are
replicated). The block ids are global, so every rank allocates the same count:
the least that any rank's memory allows. ``kv_cache_memory`` and ``swap_space``
are per rank (per device), as ``num_kv_blocks`` is per pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.kv.block_pool import blocks_for
from tandem.core.config import DEFAULT_KV_CACHE_GIB
from tandem.core.memory import GiB


@dataclass(frozen=True)
class RankMemory:
    """One rank's answer to the sizing question."""

    rank: int
    device: str  # "cpu", "cuda:1"
    block_bytes: int  # one block across the decoder layers, this rank's heads
    available_bytes: int  # free memory on ``device`` now
    host: str  # the machine's name: ranks on one host share its RAM
    host_available_bytes: int  # free RAM on that machine now


def _wanted_blocks(config, model_cls, hf_config, block_bytes: int) -> int:
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        return max(1, int(config.kv_cache_memory * GiB // block_bytes))
    # Enough for max_num_seqs requests of the longest encoder and decoder the
    # model allows (plus the watermark), but no more than the default memory.
    per_request = blocks_for(model_cls.max_encoder_len(hf_config), config.block_size) + blocks_for(
        model_cls.max_decoder_len(hf_config), config.block_size
    )
    wanted = int(config.max_num_seqs * per_request * 1.02) + 1
    return max(1, min(wanted, int(DEFAULT_KV_CACHE_GIB * GiB // block_bytes)))


def size_kv_pools(config, model_cls, hf_config, reports: list[RankMemory]) -> tuple[int, int]:
    """``(num_blocks, num_cpu_blocks)`` every rank allocates; ``ValueError`` naming the
    option when they do not fit some rank's memory."""
    num_blocks = min(_wanted_blocks(config, model_cls, hf_config, r.block_bytes) for r in reports)
    num_cpu_blocks = min(int(config.swap_space * GiB // r.block_bytes) for r in reports)
    pool = f"num_kv_blocks={config.num_kv_blocks}" if config.num_kv_blocks else f"kv_cache_memory={config.kv_cache_memory}"
    ranks = len(reports)
    per = "" if ranks == 1 else f" on each of {ranks} ranks"
    # Ranks on one host share its RAM: the host pools of all of them (and the device
    # pools of CPU ranks) come out of the same available memory.
    host_need: dict[str, int] = {}
    host_avail: dict[str, int] = {}
    for r in reports:
        kv, swap = num_blocks * r.block_bytes, num_cpu_blocks * r.block_bytes
        if r.device == "cpu":
            host_need[r.host] = host_need.get(r.host, 0) + kv + swap
        else:
            if kv > r.available_bytes:
                raise ValueError(
                    f"the KV pool ({pool}){per} needs {kv / GiB:.2f} GiB but {r.device} (rank {r.rank}) has "
                    f"{r.available_bytes / GiB:.2f} GiB available; lower it"
                )
            host_need[r.host] = host_need.get(r.host, 0) + swap
        host_avail[r.host] = r.host_available_bytes
    for host, need in host_need.items():
        if need > host_avail[host]:
            devices = {r.device for r in reports if r.host == host}
            what = (f"the KV pool ({pool}) + swap_space={config.swap_space}" if "cpu" in devices
                    else f"swap_space={config.swap_space}")
            raise ValueError(
                f"{what}{per} needs {need / GiB:.2f} GiB but this machine's RAM has "
                f"{host_avail[host] / GiB:.2f} GiB available; lower them"
            )
    return num_blocks, num_cpu_blocks

