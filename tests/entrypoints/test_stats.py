"""``LLM.get_stats()`` against the requests that were run (counting identities, as equalities).

Every request admitted runs its encoder, shares a live cross table of the same
input or takes one the encoder cache kept, so ``encoder_tokens_computed +
encoder_tokens_reused`` is the encoder length
summed over admissions: one per request, plus one per recompute preemption (a
swapped-out group comes back without a new admission). All five requests below
have encoders of one length ``L``, so that sum is ``L x admissions``.
"""

import pytest

from tandem import LLM, SamplingParams

DOC = [0, *range(10, 40), 2]  # the four sharers' encoder input
OTHER = [0, *range(40, 70), 2]  # the fifth: same length, other tokens
L = len(DOC)
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)


def _prompts():
    shared = [{"encoder_prompt": {"prompt_token_ids": DOC}, "decoder_prompt": {"prompt_token_ids": [0, 5 + i]}}
              for i in range(4)]
    return shared + [{"prompt_token_ids": OTHER}]


def _count_evictions(llm) -> list:
    """Victims seen at each eviction, counted apart from the engine's own counter."""
    sched, evictions = llm.engine.scheduler, []
    real_preempt = sched._preempt
    sched._preempt = lambda group, swap_out: evictions.append(group.request_id) or real_preempt(group, swap_out)
    return evictions


def test_stats_equal_the_work_of_a_batch_without_preemption(bart_dir):
    # 5 x (cross blocks of 32 tokens + 22 decoder tokens) / 4 tokens a block < 80: nothing is evicted.
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=80)
    for batch in (1, 2):  # the counters accumulate over calls
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        assert [o.error for o in outs] == [None] * 5
        assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
        assert [len(o.encoder_prompt_token_ids) for o in outs] == [L] * 5
        stats = llm.get_stats()
        # The first sharer runs the encoder over DOC and the three others read its cross
        # table (they are admitted while it runs); the fifth runs its own. The second
        # batch runs no encoder: both tables were kept when the first batch finished.
        assert stats["encoder_tokens_computed"] == 2 * L
        assert stats["encoder_tokens_reused"] == 3 * L + (batch - 1) * 5 * L
        assert (stats["encoder_runs"], stats["encoder_cache_hits"]) == (2, (batch - 1) * 2)
        assert stats["encoder_runs_saved"] == 3 + (batch - 1) * 5  # 3 live shares a batch, and the hits
        assert stats["encoder_cache_blocks"] == 2 * L // 4
        assert stats["num_requests_finished"] == batch * 5
        assert stats["num_requests_unfinished"] == 0
        assert stats["num_preemptions"] == 0
        assert stats["swapped_out_blocks"] == stats["swapped_in_blocks"] == 0
        assert stats["kv_blocks_total"] == 80 and stats["kv_blocks_free"] == 80


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_stats_equal_the_work_of_a_preempted_batch(bart_dir, mode):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
              preemption_mode=mode)
    evictions = _count_evictions(llm)
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    assert [o.error for o in outs] == [None] * 5
    stats = llm.get_stats()
    assert stats["num_preemptions"] == len(evictions) > 0
    admissions = 5 + (len(evictions) if mode == "recompute" else 0)
    assert stats["encoder_tokens_computed"] + stats["encoder_tokens_reused"] == L * admissions
    assert stats["encoder_tokens_computed"] >= 2 * L  # two distinct inputs, each run at least once
    if mode == "swap":
        # Every block swapped out came back (each victim finished on the device).
        assert stats["swapped_out_blocks"] == stats["swapped_in_blocks"] > 0
    else:
        assert stats["swapped_out_blocks"] == stats["swapped_in_blocks"] == 0
    assert stats["num_requests_finished"] == 5 and stats["num_requests_unfinished"] == 0
    assert stats["kv_blocks_total"] == 40 and stats["kv_blocks_free"] == 40
