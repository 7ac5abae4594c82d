"""Block sharing, step by step: the decoder prompt of an ``n > 1`` group, fork,
copy-on-write, swapping shared blocks, and cross tables shared by identical
encoder inputs."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from tandem.core.kv.block_manager import AllocStatus, BlockManager

from tandem.core.kv.block_pool import Device
from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup

_ids = itertools.count()


def make_group(encoder: list[int], prompt: list[int], n: int = 1) -> SequenceGroup:
    enc = EncoderInputs.from_token_ids(encoder)
    seqs = [Sequence(next(_ids), prompt) for _ in range(n)]
    return SequenceGroup(f"req-{next(_ids)}", enc, seqs, SamplingParams(n=n), 0.0)


def computed(group: SequenceGroup) -> None:
    """What the engine does after a forward pass, less the new token."""
    for s in group.unfinished_seqs():
        s.num_computed_tokens = len(s)


def generate(group: SequenceGroup, token: int = 5) -> None:
    computed(group)
    for s in group.unfinished_seqs():
        s.append_token(token, 0.0, None)


def check_identity(bm: BlockManager) -> None:
    for dev in Device:
        counts = Counter(b for t in bm.tables(dev) for b in t)
        refs = [bm.refcount(dev, b) for b in range(bm.num_total_blocks(dev))]
        assert all(refs[b] == counts[b] for b in range(len(refs))), dev
        assert refs.count(0) == bm.num_free_blocks(dev)


def test_n_sequences_share_the_prompt_and_copy_the_partial_block_on_write():
    bm = BlockManager(4, 32, 32, watermark=0.0)
    g = make_group([9] * 5, [2, 0, 7, 7, 7, 7], n=3)  # prompt: 1 full block + 2 tokens
    assert bm.blocks_needed(g) == 2 + 2  # cross + the shared prompt blocks, once
    assert bm.allocate(g) is True
    tables = [list(bm.get_block_table(s)) for s in g.seqs]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2
    assert [bm.refcount(Device.DEVICE, b) for b in tables[0]] == [3, 3]
    check_identity(bm)

    generate(g)  # each sequence writes its first token into the shared partial block
    assert bm.can_append_slots(g)
    free = bm.num_free_blocks()
    copies = [bm.append_slots(s) for s in g.seqs]
    full, partial = tables[0]
    # The first two copy, the last appender keeps the original.
    assert [len(c) for c in copies] == [1, 1, 0]
    assert all(src == partial for c in copies for src, _ in c)
    assert bm.num_free_blocks() == free - 2
    new_tables = [bm.get_block_table(s) for s in g.seqs]
    assert [t[0] for t in new_tables] == [full] * 3
    assert len({t[1] for t in new_tables}) == 3 and new_tables[2][1] == partial
    assert bm.refcount(Device.DEVICE, full) == 3
    assert all(bm.refcount(Device.DEVICE, t[1]) == 1 for t in new_tables)
    check_identity(bm)

    generate(g)  # nothing shared is written any more: no copies
    assert [bm.append_slots(s) for s in g.seqs] == [[], [], []]
    bm.free_group(g)
    check_identity(bm)
    assert bm.num_free_blocks() == 32


def test_full_prompt_blocks_are_never_copied():
    bm = BlockManager(4, 32, 0, watermark=0.0)
    g = make_group([9], [2, 0, 7, 7, 7, 7, 7, 7], n=4)  # exactly two blocks
    bm.allocate(g)
    generate(g)
    assert [bm.append_slots(s) for s in g.seqs] == [[], [], [], []]
    assert bm.num_free_blocks() == 32 - 1 - 2 - 4  # cross, shared prompt, one new block each
    check_identity(bm)


def test_recompute_after_divergence_shares_only_full_prompt_blocks():
    bm = BlockManager(4, 32, 0, watermark=0.0)
    g = make_group([9], [2, 0, 7, 7, 7, 7], n=2)
    bm.allocate(g)
    generate(g)
    for s in g.seqs:
        bm.append_slots(s)
    bm.free_group(g)
    g.reset_for_recompute()
    assert bm.blocks_needed(g) == 1 + 1 + 2 * 1
    bm.allocate(g)
    a, b = (bm.get_block_table(s) for s in g.seqs)
    assert a[0] == b[0] and a[1] != b[1]
    check_identity(bm)


def test_fork_shares_every_block_and_copies_on_write():
    bm = BlockManager(4, 16, 16, watermark=0.0)
    g = make_group([9], [2, 0, 7, 7, 7], n=1)
    bm.allocate(g)
    computed(g)
    parent = g.seqs[0]
    child = Sequence(next(_ids), parent.token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    g.seqs.append(child)
    bm.fork(parent, child)
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert all(bm.refcount(Device.DEVICE, b) == 2 for b in bm.get_block_table(child))
    with pytest.raises(RuntimeError):
        bm.fork(parent, child)
    check_identity(bm)
    # Swapping keeps the sharing on the host pool, moving each block once.
    held = bm.group_blocks(g)
    mapping = bm.swap_out(g)
    assert len(mapping) == held == 1 + 2
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    check_identity(bm)
    mapping = bm.swap_in(g)
    assert len(mapping) == 3
    check_identity(bm)
    for s in g.seqs:
        s.append_token(5, 0.0, None)
    copies = [bm.append_slots(s) for s in g.seqs]
    assert [len(c) for c in copies] == [1, 0]  # block 1 is partly filled and shared
    assert bm.get_block_table(parent)[0] == bm.get_block_table(child)[0]
    check_identity(bm)
    bm.free_group(g)
    assert bm.num_free_blocks() == 16 and bm.num_free_blocks(Device.HOST) == 16


def test_can_append_slots_counts_the_copies():
    bm = BlockManager(4, 4, 0, watermark=0.0)
    g = make_group([9], [2, 0, 7], n=3)  # cross 1 + shared 1: 2 free
    bm.allocate(g)
    generate(g)
    assert bm.can_append_slots(g)  # two copies, the last keeps the original
    bm2 = BlockManager(4, 3, 0, watermark=0.0)
    g2 = make_group([9], [2, 0, 7], n=3)
    bm2.allocate(g2)
    generate(g2)
    assert not bm2.can_append_slots(g2)  # 1 free < 2 copies


def test_admission_counts_shared_blocks_once():
    # The acceptance case: n=8 over a 96-token decoder prompt, block_size 16, max_tokens 16.
    bm = BlockManager(16, 40, 0, watermark=0.0)
    g = make_group(list(range(4, 10)), [2] + [5] * 95, n=8)
    assert bm.blocks_needed(g, extra_tokens=16) == 1 + 6 + 8 * 1
    assert bm.blocks_needed(g) == 1 + 6
    assert bm.can_allocate(g) is AllocStatus.OK


def test_identical_encoder_inputs_share_one_cross_table():
    bm = BlockManager(4, 32, 32, watermark=0.0)
    doc = list(range(10, 20))  # 3 blocks
    a, b = make_group(doc, [2, 0]), make_group(doc, [2, 0, 5])
    other = make_group(doc[:-1] + [99], [2, 0])  # same length, different ids
    assert bm.allocate(a) is True
    assert bm.cross_is_live(b) and not bm.cross_is_live(other)
    assert bm.blocks_needed(b, share_cross=True) == 1 and bm.blocks_needed(b) == 3 + 1
    assert bm.allocate(b) is False
    assert bm.allocate(other) is True
    cross = bm.get_cross_block_table(a)
    assert bm.get_cross_block_table(b) == cross != bm.get_cross_block_table(other)
    assert [bm.refcount(Device.DEVICE, x) for x in cross] == [2, 2, 2]
    check_identity(bm)

    # A swapped-out sharer leaves the cross blocks on the device: a still runs on them.
    mapping = bm.swap_out(b)
    assert len(mapping) == 1 and bm.cross_device(b) is Device.DEVICE
    assert bm.device_of(b) is Device.HOST
    check_identity(bm)
    # The last device holder takes the table to the HOST, and out of the share index.
    mapping = bm.swap_out(a)
    assert len(mapping) == 3 + 1
    assert bm.cross_device(a) is bm.cross_device(b) is Device.HOST
    assert bm.get_cross_block_table(a) == bm.get_cross_block_table(b)
    assert not bm.cross_is_live(make_group(doc, [2, 0]))
    check_identity(bm)
    c = make_group(doc, [2, 0])
    assert bm.allocate(c) is True  # a fresh table: the swapped one is not shared
    # b comes back with the table; c's stays the shared one for new groups.
    assert len(bm.swap_in(b)) == 3 + 1
    assert bm.cross_device(a) is Device.DEVICE and bm.device_of(a) is Device.HOST
    check_identity(bm)
    d = make_group(doc, [2, 0])
    assert bm.allocate(d) is False
    assert bm.get_cross_block_table(d) == bm.get_cross_block_table(c)
    check_identity(bm)

    # free_cross drops one reference; the last holder frees the blocks.
    for g in (a, b, c, d, other):
        bm.free_group(g)
        check_identity(bm)
    assert bm.num_free_blocks() == 32 and bm.num_free_blocks(Device.HOST) == 32
    assert bm.tables(Device.DEVICE) == [] and bm.tables(Device.HOST) == []


def test_a_recomputed_creator_shares_the_table_its_sharer_kept_alive():
    bm = BlockManager(4, 32, 0, watermark=0.0)
    doc = [7] * 9
    a, b = make_group(doc, [2, 0]), make_group(doc, [2, 0])
    assert bm.allocate(a) and not bm.allocate(b)
    cross = list(bm.get_cross_block_table(a))
    bm.free_group(a)  # recompute preemption
    a.reset_for_recompute()
    assert bm.get_cross_block_table(b) == cross
    assert bm.allocate(a) is False and bm.get_cross_block_table(a) == cross
    bm.free_group(a)
    bm.free_group(b)
    assert not bm.cross_is_live(a) and bm.num_free_blocks() == 32
