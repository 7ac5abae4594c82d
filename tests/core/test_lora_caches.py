"""The KV caches keyed by LoRA adapter: a request with adapter A never reuses adapter
B's or the base model's encoder output (a live shared cross table or one the encoder
cache kept) or decoder-prompt blocks (the prefix cache), and requests with the same
adapter still share them. The oracle is the block tables themselves: a shared block
is one whose id appears in both requests' tables."""

from __future__ import annotations

import itertools

from tandem.core.inputs import EncoderInputs
from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.block_pool import Device
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup
from tandem.core.strategies.sampling import SamplingStrategy
from tandem.lora.request import LoRARequest

_ids = itertools.count()
A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")
DOC = [7] * 9  # 3 cross blocks of 4
PROMPT = list(range(100, 110))  # 2 full decoder blocks + 2 tokens


def make_group(lora: LoRARequest | None, doc=DOC, prompt=PROMPT) -> SequenceGroup:
    gid = next(_ids)
    group = SequenceGroup(f"req-{gid}", EncoderInputs.from_token_ids(doc), [Sequence(next(_ids), prompt)],
                          SamplingParams(), 0.0, lora_request=lora)
    group.strategy = SamplingStrategy()
    return group


def _run(bm: BlockManager, g: SequenceGroup) -> None:
    """One step of the group: slots, then every new token computed (the encoder too)."""
    for s in g.unfinished_seqs():
        bm.append_slots(s)
        s.num_computed_tokens = len(s)
    g.encoder_computed = True


def _blocks(bm: BlockManager, g: SequenceGroup) -> set[int]:
    return set(bm.get_cross_block_table(g)) | set(bm.get_block_table(g.seqs[0]))


def test_a_live_cross_table_is_shared_only_with_the_same_adapter():
    bm = BlockManager(4, 64, 0, watermark=0.0, encoder_cache_blocks=0, prefix_cache_blocks=None)
    a1 = make_group(A)
    assert bm.allocate(a1) is True  # runs its encoder
    _run(bm, a1)
    a2, b, base = make_group(A), make_group(B), make_group(None)
    assert bm.has_encoder_output(a2) and not bm.has_encoder_output(b) and not bm.has_encoder_output(base)
    assert bm.allocate(a2) is False  # shares a1's cross table: no encoder run
    assert bm.get_cross_block_table(a2) == bm.get_cross_block_table(a1)
    assert bm.num_prefix_hit_tokens(b) == 0 and bm.num_prefix_hit_tokens(base) == 0
    assert bm.allocate(b) is True and bm.allocate(base) is True
    assert not _blocks(bm, b) & _blocks(bm, a1)
    assert not _blocks(bm, base) & (_blocks(bm, a1) | _blocks(bm, b))


def test_kept_encoder_output_and_prompt_blocks_are_taken_only_with_the_same_adapter():
    bm = BlockManager(4, 64, 0, watermark=0.0, encoder_cache_blocks=None, prefix_cache_blocks=None)
    a = make_group(A)
    bm.allocate(a)
    _run(bm, a)
    kept_prompt = bm.get_block_table(a.seqs[0])[:2]  # its full prompt blocks (the partial third is freed)
    kept = set(bm.get_cross_block_table(a)) | set(kept_prompt)
    bm.free_group(a)
    assert bm.num_cached_blocks() == 3 and bm.num_prefix_cached_blocks() == 2
    assert all(bm.pools[Device.DEVICE].is_kept(blk) for blk in kept)
    for other in (make_group(B), make_group(None), make_group(LoRARequest("a", 1, "/adapters/elsewhere"))):
        assert not bm.has_encoder_output(other) and bm.num_prefix_hit_tokens(other) == 0
        assert bm.allocate(other) is True  # its own encoder run
        assert not _blocks(bm, other) & kept  # nothing of a's, though the inputs are equal
        _run(bm, other)
    again = make_group(A)
    assert bm.has_encoder_output(again) and bm.num_prefix_hit_tokens(again) == 8
    assert bm.allocate(again) is False
    assert bm.get_block_table(again.seqs[0])[:2] == kept_prompt
    assert again.seqs[0].num_computed_tokens == 8


def test_the_base_model_keeps_sharing_as_before():
    # The key of a request without an adapter is its encoder inputs' key, unchanged.
    g = make_group(None)
    assert g.encoder_key == g.encoder_inputs.cache_key and g.lora_id == 0
    assert make_group(A).encoder_key != g.encoder_key and make_group(A).lora_id == 1
