"""The encoder cache end to end: a request whose encoder input an earlier, finished
request had skips its encoder (counted on the model's encoder module itself) and
still equals HF's greedy ``generate`` token for token (float32); under memory
pressure kept tables are evicted before anything is preempted; the option is
validated and the counters reach ``get_stats()`` and ``/metrics``."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import WHISPER_IDS as I
from helpers import hf_greedy, make_whisper, synth_audio
from tandem import LLM, SamplingParams
from tandem.core.kv.block_pool import Device, blocks_for

rng = random.Random(11)
DOCS = [[0, *(rng.randrange(4, 96) for _ in range(28)), 2] for _ in range(6)]  # 30 tokens: 8 blocks of 4


def _prompt(doc: list[int], decoder: list[int]) -> dict:
    return {"encoder_prompt": {"prompt_token_ids": doc}, "decoder_prompt": {"prompt_token_ids": decoder}}


def _count_encoder_runs(llm, monkeypatch) -> list[int]:
    """The batch size of each call of the model's encoder (the engine's counters aside)."""
    encoder, calls = llm.engine.model.model.encoder, []
    real = encoder.forward

    def counting(x, *args, **kwargs):
        calls.append(len(x) if isinstance(x, list) or x.dim() == 3 else 1)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(encoder, "forward", counting)
    return calls


def _all_free(llm) -> bool:
    bm = llm.engine.block_manager
    return all(bm.num_free_blocks(d) == bm.num_total_blocks(d) and bm.tables(d) == [] for d in Device)


def test_the_same_source_twice_runs_the_encoder_once_and_equals_hf(bart_dir, monkeypatch):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4)
    calls = _count_encoder_runs(llm, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    first = llm.generate(_prompt(DOCS[0], [0, 7]), params, use_tqdm=False)[0]
    assert calls == [1] and llm.get_stats()["encoder_cache_blocks"] == blocks_for(len(DOCS[0]), 4)
    again = llm.generate(_prompt(DOCS[0], [0, 7]), params, use_tqdm=False)[0]
    other_question = llm.generate(_prompt(DOCS[0], [0, 51, 9]), params, use_tqdm=False)[0]
    assert calls == [1]  # neither later request ran the encoder
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    for o in (first, again, other_question):
        assert o.outputs[0].token_ids == hf_greedy(bart_dir, DOCS[0], o.prompt_token_ids, 12)
    stats = llm.get_stats()
    assert (stats["encoder_runs"], stats["encoder_cache_hits"], stats["encoder_runs_saved"]) == (1, 2, 2)
    assert stats["encoder_cache_misses"] == 1 and stats["encoder_cache_evictions"] == 0
    assert stats["encoder_tokens_computed"] == len(DOCS[0]) and stats["encoder_tokens_reused"] == 2 * len(DOCS[0])
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and _all_free(llm)


def test_with_the_cache_off_the_encoder_runs_again(bart_dir, monkeypatch):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, encoder_cache_blocks=0)
    calls = _count_encoder_runs(llm, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outs = [llm.generate(_prompt(DOCS[0], [0, 7]), params, use_tqdm=False)[0] for _ in range(2)]
    assert calls == [1, 1] and outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    stats = llm.get_stats()
    assert (stats["encoder_runs"], stats["encoder_cache_hits"], stats["encoder_cache_blocks"]) == (2, 0, 0)


def test_an_aborted_request_s_filled_table_is_kept(bart_dir, monkeypatch):
    # Aborted after its first step: its cross table holds the encoder's K/V, so it is kept.
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4)
    calls = _count_encoder_runs(llm, monkeypatch)
    eng = llm.engine
    eng.add_request("a", _prompt(DOCS[1], [0, 7]), SamplingParams(temperature=0.0, max_tokens=12))
    eng.step()
    eng.abort_request({"a"})
    assert llm.get_stats()["encoder_cache_blocks"] == blocks_for(len(DOCS[1]), 4)
    out = llm.generate(_prompt(DOCS[1], [0, 7]), SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert calls == [1] and out.outputs[0].token_ids == hf_greedy(bart_dir, DOCS[1], out.prompt_token_ids, 12)


def test_kept_tables_are_evicted_before_anything_waits_or_is_preempted(bart_dir, monkeypatch):
    # 40 blocks of 4. Five finished documents leave at least 4 x 8 kept blocks; then four
    # new documents at once need 4 x (8 cross + 6 self) = 56 > 40 at full length: requests
    # are preempted, and each refusal must be one that evicting every kept table could
    # not have avoided.
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
              preemption_mode="recompute")
    for doc in DOCS[:5]:
        llm.generate(_prompt(doc, [0]), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_cached_blocks() >= 32  # the cache holds most of the pool

    refusals, real = [], bm.can_append_slots

    def checked(group):
        ok = real(group)
        if not ok:  # n = 1: no copy-on-write, so the need is the blocks its tokens lack
            need = sum(blocks_for(len(s), 4) - len(bm.get_block_table(s)) for s in group.unfinished_seqs()
                       if bm.has_block_table(s))
            refusals.append((need, bm.pools[Device.DEVICE].num_free, bm.num_cached_blocks()))
        return ok

    monkeypatch.setattr(bm, "can_append_slots", checked)
    new = [DOCS[5], *([d[::-1] for d in DOCS[:3]])]
    outs = llm.generate([_prompt(d, [0, 3]) for d in new], params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["encoder_cache_evictions"] >= 5 and stats["num_preemptions"] > 0
    assert refusals and all(need > free + kept for need, free, kept in refusals), refusals
    for d, o in zip(new, outs):
        assert o.error is None and o.outputs[0].token_ids == hf_greedy(bart_dir, d, o.prompt_token_ids, 20, 20)
    assert _all_free(llm)


def test_eviction_leaves_outputs_unchanged_and_preempts_nothing(bart_dir):
    # Two new documents need 2 x (8 + 6) = 28 of 40 blocks: they fit once kept tables go.
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
    prompts = [_prompt(DOCS[5], [0, 3]), _prompt(DOCS[4][::-1], [0, 4])]
    outs = {}
    for bound in (None, 0):
        llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
                  encoder_cache_blocks=bound)
        for doc in DOCS[:5]:
            llm.generate(_prompt(doc, [0]), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        outs[bound] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
        assert stats["num_preemptions"] == 0
        assert (stats["encoder_cache_evictions"] > 0) == (bound is None)
    assert outs[None] == outs[0]


@pytest.mark.parametrize("bad", [-1, 2.5, "all"])
def test_a_bad_encoder_cache_bound_is_refused_naming_it(bart_dir, bad):
    with pytest.raises(ValueError, match=f"encoder_cache_blocks={bad!r}"):
        LLM(model=str(bart_dir), dtype="float32", device="cpu", encoder_cache_blocks=bad)


def test_metrics_show_the_encoder_cache(bart_dir):
    from prometheus_client import generate_latest

    from tandem.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for _ in range(3):
        llm.generate(_prompt(DOCS[2], [0, 5]), params, use_tqdm=False)
    text = generate_latest(ServerMetrics(llm.engine).registry).decode()
    for line in ("tandem:encoder_runs_total 1.0", "tandem:encoder_cache_hits_total 2.0",
                 "tandem:encoder_cache_misses_total 1.0", "tandem:encoder_runs_saved_total 2.0",
                 "tandem:encoder_cache_evictions_total 0.0", "tandem:encoder_cache_blocks 8.0"):
        assert line in text.splitlines(), line


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    path = make_whisper(tmp_path_factory.mktemp("whisper") / "ckpt", num_mel_bins=80, seed=80)
    return path, LLM(model=str(path), dtype="float32", device="cpu")


def test_whisper_the_same_audio_twice_runs_the_encoder_once_and_equals_hf(whisper, monkeypatch):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.generation.utils import GenerationMixin

    path, llm = whisper
    calls = _count_encoder_runs(llm, monkeypatch)
    clip = synth_audio(6.0, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=12, suppress_tokens=[], begin_suppress_tokens=[])
    decoders = [[I["sot"], I["en"], I["transcribe"], I["notimestamps"]],
                [I["sot"], I["de"], I["translate"], I["notimestamps"]]]
    outs = [llm.generate({"encoder_prompt": {"audio": clip, "sampling_rate": 16000},
                          "decoder_prompt": {"prompt_token_ids": d}}, params, use_tqdm=False)[0]
            for d in (decoders[0], decoders[0], decoders[1])]
    assert calls == [1]  # the second and third request read the first's cross table
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    model = WhisperForConditionalGeneration.from_pretrained(path).eval()
    features = WhisperFeatureExtractor(feature_size=80)(clip, sampling_rate=16000, return_tensors="pt").input_features
    for d, o in zip((decoders[0], decoders[0], decoders[1]), outs):
        with torch.no_grad():
            ref = GenerationMixin.generate(model, input_features=features, decoder_input_ids=torch.tensor([d]),
                                           do_sample=False, num_beams=1, max_new_tokens=12)
        assert o.error is None and o.outputs[0].token_ids == ref[0, len(d):].tolist()
    assert llm.get_stats()["encoder_cache_hits"] == 2


def test_a_failed_step_keeps_no_table(bart_dir, monkeypatch):
    # The request's encoder ran in step 1; step 3 fails. Its table is filled, but a failed
    # step may have torn a swap, so the cache drops every kept table rather than trust one.
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4)
    llm.generate(_prompt(DOCS[3], [0, 5]), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert llm.get_stats()["encoder_cache_blocks"] > 0  # an earlier request's table is kept
    worker, calls = llm.engine.worker, {"n": 0}
    real = worker.execute_model

    def failing_third(out, *rest):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the forward failed")
        return real(out, *rest)

    monkeypatch.setattr(worker, "execute_model", failing_third)
    out = llm.generate(_prompt(DOCS[4], [0, 5]), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert "the forward failed" in out.error
    stats = llm.get_stats()
    # Both went: the earlier request's table and the failed one's (kept as its abort freed it).
    assert stats["encoder_cache_blocks"] == 0 and stats["encoder_cache_evictions"] == 2 and _all_free(llm)
    monkeypatch.undo()
    again = llm.generate(_prompt(DOCS[4], [0, 5]), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert again.error is None and llm.get_stats()["encoder_runs"] == 3  # nothing was kept: it ran again
