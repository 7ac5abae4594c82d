"""Block accounting under speculation: random rounds of propose (draft slots
appended), verify (a random number accepted) and roll back, over groups of one or
more sequences sharing their prompt's blocks (copy-on-write), next to a fake
cache that records what every slot holds. After every operation:

- each sequence holds exactly the blocks its tokens need: ``blocks_for(len +
  drafts)`` after the append, ``blocks_for(len)`` (capped by what it held)
  after the rollback; a block that held only rejected tokens is free again;
- on the pool, free + distinct held = total, and every block's refcount is the
  number of tables holding it;
- every sequence reads its accepted, computed tokens back through its table.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.kv.block_manager import BlockManager

from tandem.core.kv.block_pool import Device, blocks_for
from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus

DEV = Device.DEVICE
_tokens = itertools.count(10_000)


def check_pool(bm: BlockManager) -> None:
    tables = bm.tables(DEV)
    held = Counter(b for t in tables for b in t)
    total = bm.num_total_blocks(DEV)
    assert bm.num_free_blocks(DEV) + len(held) == total
    for b in range(total):
        assert bm.refcount(DEV, b) == held.get(b, 0)


@settings(max_examples=120, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    groups=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 3)), min_size=1, max_size=3),
    rounds=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12),
)
def test_propose_accept_reject_keeps_blocks_exact(block_size, groups, rounds):
    bm = BlockManager(block_size, num_device_blocks=400, num_host_blocks=0, watermark=0.0)
    cache: dict[tuple[int, int], int] = {}  # (block, slot) -> token written there
    live = []
    for gid, (prompt_len, n) in enumerate(groups):
        prompt = [1_000 * (gid + 1) + i for i in range(prompt_len)]
        seqs = [Sequence(100 * gid + i, prompt, i) for i in range(n)]
        g = SequenceGroup(f"r{gid}", EncoderInputs.from_token_ids([5, 6, 7]), seqs, SamplingParams(n=n), 0.0)
        bm.allocate(g)
        for s in seqs:
            s.status = SequenceStatus.RUNNING
        live.append(g)
    check_pool(bm)

    def write(seq: Sequence, tokens: list[int]) -> None:
        table = bm.get_block_table(seq)
        for pos, t in enumerate(tokens, start=seq.num_computed_tokens):
            cache[(table[pos // block_size], pos % block_size)] = t

    for num_drafts, num_accepted in rounds:
        for g in live:
            for s in g.seqs:
                s.lookahead_token_ids = [next(_tokens) for _ in range(num_drafts)]
                for src, dst in bm.append_slots(s):  # copy-on-write, as the worker does
                    for slot in range(block_size):
                        if (src, slot) in cache:
                            cache[(dst, slot)] = cache[(src, slot)]
                assert len(bm.get_block_table(s)) == blocks_for(len(s) + num_drafts, block_size)
            check_pool(bm)
            for s in g.seqs:  # the forward writes the new tokens and the drafts
                write(s, s.token_ids[s.num_computed_tokens:] + s.lookahead_token_ids)
            for s in g.seqs:
                a = min(num_accepted, num_drafts)
                held = len(bm.get_block_table(s))
                accepted, s.lookahead_token_ids = s.lookahead_token_ids[:a], []
                s.num_computed_tokens = len(s) + a
                for t in accepted + [next(_tokens)]:  # the accepted drafts, then the target's token
                    s.append_token(t, None, None)
                freed = bm.rollback_slots(s)
                assert len(bm.get_block_table(s)) == min(held, blocks_for(len(s), block_size))
                assert freed == held - len(bm.get_block_table(s))
            check_pool(bm)
            for s in g.seqs:
                table = bm.get_block_table(s)
                got = [cache.get((table[p // block_size], p % block_size)) for p in range(s.num_computed_tokens)]
                assert got == s.token_ids[: s.num_computed_tokens]
    for g in live:
        bm.free_group(g)
    assert bm.num_free_blocks(DEV) == bm.num_total_blocks(DEV)
