"""``LLM.get_stats()`` against the requests that were run (a counting identity)."""

from tandem import LLM, SamplingParams


def test_stats_count_encoder_work_requests_and_blocks(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40)
    doc = [0, *range(10, 40), 2]
    prompts = [{"encoder_prompt": {"prompt_token_ids": doc}, "decoder_prompt": {"prompt_token_ids": [0, 5 + i]}}
               for i in range(4)]
    prompts.append({"prompt_token_ids": [0, 7, 8, 2]})
    sched, evictions = llm.engine.scheduler, []
    real_preempt = sched._preempt
    sched._preempt = lambda group, swap_out: evictions.append(group) or real_preempt(group, swap_out)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20), use_tqdm=False)
    assert all(o.error is None for o in outs)
    stats = llm.get_stats()
    total_encoder = sum(len(o.encoder_prompt_token_ids) for o in outs)
    # Each encoder token is either computed or reused, once per admission (recompute preemption
    # admits again), and the four requests over one document compute it at least once.
    assert stats["encoder_tokens_computed"] + stats["encoder_tokens_reused"] >= total_encoder
    assert stats["encoder_tokens_computed"] >= len(doc) + 4 and stats["encoder_tokens_reused"] >= len(doc)
    assert stats["num_requests_finished"] == 5 and stats["num_requests_unfinished"] == 0
    assert stats["kv_blocks_total"] == 40 and stats["kv_blocks_free"] == 40
    assert stats["num_preemptions"] == len(evictions)  # counted independently, at each eviction
