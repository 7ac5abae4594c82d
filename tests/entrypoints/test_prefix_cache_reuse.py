"""The prefix cache end to end: requests whose decoder prompt begins with blocks an
earlier request (live or finished) computed over the same encoder input skip them,
and greedy outputs equal those with the cache off and HF's ``generate`` token for
token (float32): BART few-shot decoder prompts batched, under preemption by
recompute and by swap, with beam search; Whisper with a fixed prompt prefix
(previous text, then the task tokens). Counters reach ``get_stats()`` and ``/metrics``."""

from __future__ import annotations

import random

import pytest

from helpers import WHISPER_IDS as I
from helpers import hf_greedy, hf_search, make_whisper, synth_audio
from tandem import LLM, SamplingParams
from tandem.core.kv.block_pool import Device

rng = random.Random(5)
DOC = [0, *(rng.randrange(4, 96) for _ in range(18)), 2]
OTHER_DOC = [0, *(rng.randrange(4, 96) for _ in range(18)), 2]
SHOTS = [rng.randrange(4, 96) for _ in range(13)]  # the few-shot examples every question follows
QUESTIONS = [[rng.randrange(4, 96) for _ in range(1 + i % 3)] for i in range(6)]
BS = 4
# [decoder_start, bos] + 13 shot tokens = 15: 3 full blocks of 4 every question shares.
SHARED_BLOCKS = (2 + len(SHOTS)) // BS


def _prompt(doc: list[int], question: list[int]) -> dict:
    return {"encoder_prompt": {"prompt_token_ids": doc},
            "decoder_prompt": {"prompt_token_ids": [2, 0, *SHOTS, *question]}}


def _tokens(outs) -> list[list[int]]:
    assert [o.error for o in outs] == [None] * len(outs)
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _all_free(llm) -> bool:
    bm = llm.engine.block_manager
    return all(bm.num_free_blocks(d) == bm.num_total_blocks(d) and bm.tables(d) == [] for d in Device)


def _llm(bart_dir, **kw) -> LLM:
    return LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=BS, **kw)


def test_few_shot_questions_skip_the_shared_blocks_and_equal_the_cache_off_and_hf(bart_dir):
    params = SamplingParams(temperature=0.0, max_tokens=10)
    on, off = _llm(bart_dir), _llm(bart_dir, prefix_cache_blocks=0)
    first = on.generate(_prompt(DOC, QUESTIONS[0]), params, use_tqdm=False)  # computes the shared blocks
    stats = on.get_stats()
    assert stats["prefix_cache_hit_tokens"] == 0 and stats["prefix_cache_blocks"] >= SHARED_BLOCKS
    batch = [_prompt(DOC, q) for q in QUESTIONS[1:]] + [_prompt(OTHER_DOC, QUESTIONS[1])]
    outs = _tokens(first) + _tokens(on.generate(batch, params, use_tqdm=False))
    stats = on.get_stats()
    # Each question over DOC skipped the shared blocks; the same prompt over another
    # document skipped nothing (the chain's root is the encoder input).
    assert stats["prefix_cache_hit_tokens"] == (len(QUESTIONS) - 1) * SHARED_BLOCKS * BS
    prompt_lens = [2 + len(SHOTS) + len(q) for q in QUESTIONS] + [2 + len(SHOTS) + len(QUESTIONS[1])]
    assert stats["prefix_cache_queried_tokens"] == sum(prompt_lens)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hit_tokens"] / sum(prompt_lens))
    ref = _tokens(off.generate([_prompt(DOC, QUESTIONS[0])] + batch, params, use_tqdm=False))
    assert outs == ref
    assert off.get_stats()["prefix_cache_hit_tokens"] == off.get_stats()["prefix_cache_blocks"] == 0
    for p, toks in zip([_prompt(DOC, QUESTIONS[0])] + batch, outs):
        assert toks == hf_greedy(bart_dir, p["encoder_prompt"]["prompt_token_ids"],
                                 p["decoder_prompt"]["prompt_token_ids"], 10)
    assert _all_free(on) and on.get_stats()["kv_blocks_free"] == on.get_stats()["kv_blocks_total"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_under_preemption_outputs_equal_the_cache_off(bart_dir, mode):
    # 8 requests of 2 sequences, 3 at a time, over a 34-block pool: preempted, and those
    # admitted later (or readmitted, to recompute) find their neighbours' (their own) prompt blocks.
    params = SamplingParams(temperature=0.0, max_tokens=14, min_tokens=14, n=2)
    prompts = [_prompt(DOC if i % 2 else OTHER_DOC, QUESTIONS[i % 6]) for i in range(8)]
    on = _llm(bart_dir, num_kv_blocks=34, preemption_mode=mode, max_num_seqs=6)
    outs = _tokens(on.generate(prompts, params, use_tqdm=False))
    stats = on.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    if mode == "swap":
        assert stats["swapped_out_blocks"] > 0
    assert _all_free(on)
    ref = _tokens(_llm(bart_dir, prefix_cache_blocks=0).generate(prompts, params, use_tqdm=False))
    assert outs == ref


def test_beam_search_forks_share_the_cached_prompt_and_equal_hf(bart_dir):
    params = SamplingParams(max_tokens=8, num_beams=3, n=2)
    on = _llm(bart_dir)
    on.generate(_prompt(DOC, QUESTIONS[0]), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    prompts = [_prompt(DOC, q) for q in QUESTIONS[1:3]]
    outs = on.generate(prompts, params, use_tqdm=False)
    assert on.get_stats()["prefix_cache_hit_tokens"] == 2 * SHARED_BLOCKS * BS
    for p, o in zip(prompts, outs):
        ref = hf_search(bart_dir, DOC, p["decoder_prompt"]["prompt_token_ids"], do_sample=False, num_beams=3,
                        num_return_sequences=2, max_new_tokens=8)
        assert [list(c.token_ids) for c in o.outputs] == [toks for toks, _ in ref]
    assert _all_free(on)


def test_metrics_export_the_prefix_cache_counters(bart_dir):
    from tandem.entrypoints.openai.metrics import ServerMetrics
    from prometheus_client import generate_latest

    llm = _llm(bart_dir)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(_prompt(DOC, QUESTIONS[0]), params, use_tqdm=False)
    llm.generate(_prompt(DOC, QUESTIONS[1]), params, use_tqdm=False)
    stats = llm.get_stats()
    text = generate_latest(ServerMetrics(llm.engine).registry).decode()
    for line in (f"tandem:prefix_cache_queries_total {stats['prefix_cache_queried_tokens']:.1f}",
                 f"tandem:prefix_cache_hits_total {float(SHARED_BLOCKS * BS):.1f}",
                 f"tandem:prefix_cache_blocks {stats['prefix_cache_blocks']:.1f}",
                 "tandem:prefix_cache_evictions_total 0.0"):
        assert line in text.splitlines(), line
    assert f"tandem:prefix_cache_hit_rate {stats['prefix_cache_hit_rate']!r}" in text


def test_whisper_a_fixed_prompt_prefix_is_computed_once(tmp_path_factory):
    # The same window decoded again with the same previous-text prompt (what a
    # temperature fallback or a second task over one clip does): the prompt's
    # blocks, <|startofprev|> and the previous text, come from the cache.
    path = make_whisper(tmp_path_factory.mktemp("whisper") / "ckpt", num_mel_bins=80, seed=80)
    clip = synth_audio(4.0, seed=7)
    prev = [I["prev"], 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]  # 12 tokens: 3 full blocks
    tasks = [[I["sot"], I["en"], I["transcribe"], I["notimestamps"]], [I["sot"], I["de"], I["translate"]]]
    prompts = [{"encoder_prompt": {"audio": clip, "sampling_rate": 16000},
                "decoder_prompt": {"prompt_token_ids": prev + t}} for t in (tasks[0], tasks[0], tasks[1])]
    params = SamplingParams(temperature=0.0, max_tokens=10, suppress_tokens=[], begin_suppress_tokens=[])
    outs = {}
    for bound in (None, 0):
        llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=BS, prefix_cache_blocks=bound)
        outs[bound] = [_tokens(llm.generate(p, params, use_tqdm=False))[0] for p in prompts]
        hits = llm.get_stats()["prefix_cache_hit_tokens"]
        # The first request computes prev's 3 blocks and the task's block; the repeat
        # finds prev's 3 (not the 4th: its last token is left to compute, for its
        # logits), and so does the other task.
        assert hits == (12 + 12 if bound is None else 0)
    assert outs[None] == outs[0]
