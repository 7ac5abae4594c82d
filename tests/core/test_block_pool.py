"""``BlockPool``'s allocations against what they were before its free runs were kept
(``BlockPool._runs``): the run a cross table takes was found by a scan of the whole
pool on every call. Random allocations, runs, frees (of a few blocks one by one, of
more in numpy, repeats counting), keeps, reuses and evictions; each allocation's ids
must equal the scan's answer (the best-fitting run's highest ids, else the lowest free
ids), the counts the references held, a double free raise and leave the pool as it was,
and the kept runs be the pool's free blocks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.kv.block_pool import BlockPool


def scan_run(pool: BlockPool, n: int) -> list[int] | None:
    """The old ``allocate_run``'s choice, without taking it (None: no run fits)."""
    is_free = ((pool.refcounts == 0) & ~pool._kept).view(np.int8)
    edges = np.diff(np.concatenate(([0], is_free, [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    lengths = ends - starts
    fits = np.flatnonzero(lengths >= n)
    if fits.size == 0:
        return None
    end = int(ends[fits[np.argmin(lengths[fits])]])
    return list(range(end - n, end))


def runs_of(free: list[int]) -> tuple[list[int], list[int]]:
    starts, ends = [], []
    for b in free:
        if ends and ends[-1] == b:
            ends[-1] += 1
        else:
            starts.append(b)
            ends.append(b + 1)
    return starts, ends


ops = st.lists(st.tuples(st.sampled_from(["alloc", "run", "free", "free_many", "keep", "reuse", "evict", "incref",
                                          "double_free"]),
                         st.integers(0, 7), st.integers(0, 10 ** 6)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.sampled_from([1, 7, 40, 120]), loop_runs=st.sampled_from([0, 2, 16]),
       few_blocks=st.sampled_from([0, 3, 16]), script=ops)
def test_allocations_equal_a_scan_of_the_pool(num_blocks, loop_runs, few_blocks, script):
    pool = BlockPool(num_blocks)
    pool.loop_runs = loop_runs  # the best fit found in a loop, or in numpy
    pool.few_blocks = few_blocks  # references dropped one by one, or in numpy
    held: list[int] = []  # one entry per reference
    kept: list[int] = []
    for op, n, pick in script:
        if op == "alloc" and n <= pool.num_free:
            lowest = sorted(pool.free_ids())[:n]
            got = pool.allocate(n)
            assert got == lowest
            held += got
        elif op == "run" and n <= pool.num_free:
            want = scan_run(pool, n)
            lowest = sorted(pool.free_ids())[:n]
            got = pool.allocate_run(n)
            assert got == (lowest if want is None and n else want or [])
            held += got
        elif op == "free" and held:
            b = held.pop(pick % len(held))
            pool.free([b])
        elif op == "free_many" and held:
            k = 1 + pick % len(held)  # a prefix of a shuffle: repeats of a block count
            order = sorted(range(len(held)), key=lambda i: (i * 7919 + pick) % len(held))[:k]
            drop = [held[i] for i in order]
            for i in sorted(order, reverse=True):
                del held[i]
            pool.free(drop)
        elif op == "double_free":
            extra = [b for b in range(num_blocks) if b not in held][: 1 + n % 3]
            if extra:
                before = (pool.refcounts.copy(), pool.num_free, sorted(pool.free_ids()))
                with pytest.raises(RuntimeError):
                    pool.free(held[:n] + extra)
                assert (pool.refcounts == before[0]).all() and (pool.num_free, sorted(pool.free_ids())) == before[1:]
        elif op == "incref" and held:
            b = held[pick % len(held)]
            pool.incref([b])
            held.append(b)
        elif op == "keep" and held:
            b = held[pick % len(held)]
            if held.count(b) == 1:
                held.remove(b)
                pool.keep([b])
                kept.append(b)
        elif op == "reuse" and kept:
            b = kept.pop(pick % len(kept))
            pool.reuse([b])
            held.append(b)
        elif op == "evict" and kept:
            pool.evict([kept.pop(pick % len(kept))])
        assert pool.num_free == len(pool.free_ids())
        counts = Counter(held)
        assert pool.refcounts.tolist() == [counts.get(b, 0) for b in range(num_blocks)]
        if pool._runs is not None:
            assert pool._runs == runs_of(pool.free_ids())
