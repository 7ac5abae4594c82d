"""kv_compress (cross-attention KV compression): settings, the re-pack against a float64
reference, and engine runs (keep 1.0 exact, block accounting, n > 1 and beams, preemption)."""

from __future__ import annotations

import json

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.attention import AttentionType, KVCacheSpec
from tandem.core.kv.block_pool import blocks_for
from tandem.core.kv_compress_config import FEATURE, KVCompressConfig
from tandem.core.layers import Attention
from tandem.core.scheduler_output import CrossRepack
from tandem.core.worker.cross_compress import CrossKVCompressor
from pathlib import Path

import tandem

DEMO_BART = Path(tandem.__file__).parent / "demo_model"
from tests.backends.layouts import Seq, reference, step_inputs

SENTENCES = [s["input"] for s in json.loads((DEMO_BART / "demo_sentences.json").read_text())]
# Long enough encoder inputs (20-40 tokens) that a small block size frees blocks.
LONG = [" ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(3 + i % 3)) for i in range(8)]
# Block size 4, everything compressible: 30% kept (at least 1) after 2 decode steps.
# Small pools: the default sizing (up to 1 GiB + 1 GiB swap) is far more than these runs need.
POOL = dict(num_kv_blocks=600, swap_space=0.01)
SMALL = dict(block_size=4, dtype="float32", device="cpu", swap_space=0.01,
             kv_compress={"keep_fraction": 0.3, "window": 2, "min_keep": 1})


@pytest.mark.parametrize("value, named", [
    ({"keep_fraction": 0}, "keep_fraction=0"),
    ({"keep_fraction": 1.5}, "keep_fraction=1.5"),
    ({"window": 0}, "window=0"),
    ({"min_keep": "8"}, "min_keep='8'"),
    ({"keep": 0.5}, "'keep'"),
    ("{not json", "not a JSON object"),
    (3, "must be None, True or a dict"),
])
def test_a_bad_kv_compress_raises_at_construction_naming_it(value, named):
    with pytest.raises(ValueError, match="kv_compress") as e:
        LLM(model=str(DEMO_BART), dtype="float32", device="cpu", kv_compress=value, **POOL)
    assert named in str(e.value)


def test_settings_parse_from_json_and_round_kept_positions_up_to_blocks():
    c = KVCompressConfig.parse('{"keep_fraction": 0.25, "window": 3}')
    assert (c.keep_fraction, c.window, c.min_keep) == (0.25, 3, 32)
    assert KVCompressConfig.parse("true") == KVCompressConfig() and KVCompressConfig.parse(None) is None
    assert c.kept_positions(1500, 16) == 384  # ceil(375 / 16) blocks of 16
    assert c.kept_positions(20, 16) == 20  # min_keep 32 > 20: all of them


@pytest.mark.parametrize("name", ["xformers", "flash_attn"])
def test_backends_without_the_feature_are_passed_over_naming_it(name):
    from tandem.plugins import default_backend_registry

    reasons = default_backend_registry().load(name).feature_reasons(frozenset({FEATURE}))
    assert len(reasons) == 1 and f"attention feature {FEATURE} is not served" in reasons[0]


def _backends():
    from tandem.backends.cpu_paged.backend import CPUPagedBackend
    from tandem.backends.torch_sdpa import TorchSDPABackend

    out = [TorchSDPABackend]
    if not CPUPagedBackend.unsupported_reasons(torch.device("cpu"), torch.float32, 8,
                                               frozenset(AttentionType), 4, torch.float32):
        out.append(CPUPagedBackend)
    return out


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("q_len", [1, 3])  # a decode (cpu_paged's C++ op) and a prefill
@pytest.mark.parametrize("in_place", [False, True], ids=["new_blocks", "in_place"])
def test_attention_over_the_repacked_cache_equals_float64_over_each_heads_kept_positions(backend, q_len, in_place):
    g = torch.Generator().manual_seed(0)
    layers, kv_heads, heads, d, bs, n_enc, kept_n = 2, 2, 4, 8, 4, 37, 13
    caches = [backend.allocate_kv_cache(48, bs, kv_heads, d, torch.float32, "cpu") for _ in range(layers)]
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g))
    src = [40, 3, 17, 8, 22, 31, 5, 12, 29, 44]  # 10 blocks hold 37 positions
    dst = src[:4] if in_place else [11, 45, 2, 36]  # 4 blocks hold 13 (a sole holder keeps its first ones)
    original = [c.clone().double() for c in caches]
    # Layer 0: concentrated heads (13 positions hold > 95% of the attention); layer 1: diffuse.
    scores = torch.rand(layers, kv_heads, n_enc, generator=g) * 1e-3
    hot = torch.rand(kv_heads, n_enc, generator=g).argsort(-1)[:, :kept_n]
    scores[0].scatter_(-1, hot, 1.0)
    scores[1] += 1.0
    comp = CrossKVCompressor(layers, kv_heads, bs)
    comp.scores["r"] = {(7, 0): scores / 2, (7, 1): scores / 2}
    kept = comp.repack(CrossRepack("r", src, n_enc, dst, kept_n), caches)
    # The independent choice: concentrated heads keep their 13 most attended positions,
    # diffuse ones 13 evenly spaced (0, 3, 6, ..., 36).
    assert torch.equal(kept[0], hot.sort(-1).values)
    assert kept[1].tolist() == [list(range(0, 37, 3))] * kv_heads

    seq = Seq(group=0, ctx=2, q_len=q_len, table=[0, 1], enc_len=kept_n, cross=dst, run_encoder=False)
    inputs = step_inputs([seq], bs)
    md = backend.get_metadata_builder_cls()(bs, torch.device("cpu"), KVCacheSpec(layers, kv_heads, d)).build(inputs)
    for layer in range(layers):
        attn = Attention(heads, d, 0.35, backend, AttentionType.ENCODER_DECODER, num_kv_heads=kv_heads)
        q = torch.randn(q_len, heads * d, generator=g)
        out = attn(q, None, None, caches[layer], md).view(q_len, heads, d)
        flat = original[layer].view(2, -1, kv_heads, d)
        pos = kept[layer]  # [kv_heads, 13]
        table = torch.tensor(src)
        slots = table[pos // bs] * bs + pos % bs
        for h in range(kv_heads):  # each KV head over its own kept positions, its query heads with it
            k, v = flat[0, slots[h], h][:, None], flat[1, slots[h], h][:, None]
            qh = q.view(q_len, heads, d)[:, 2 * h:2 * h + 2].double()
            want = reference(qh, k, v, 0.35)
            torch.testing.assert_close(out[:, 2 * h:2 * h + 2].double(), want, atol=2e-5, rtol=1e-4)


def _texts(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_keep_one_equals_the_uncompressed_run_exactly():
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = LLM(model=str(DEMO_BART), dtype="float32", device="cpu", block_size=4, **POOL)
    full = LLM(model=str(DEMO_BART), dtype="float32", device="cpu", block_size=4, **POOL,
               kv_compress={"keep_fraction": 1.0, "window": 1, "min_keep": 1})
    assert _texts(full, LONG, params) == _texts(plain, LONG, params)


def _run_steps(llm, prompts, params):
    """Step the engine to the end, checking the pool's accounting after every step;
    returns the outputs by request id and the cross table sizes seen once compressed."""
    engine = llm.llm_engine
    bm, sched = engine.block_manager, engine.scheduler
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs, sizes = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = [c.token_ids for c in o.outputs]
        assert bm.accounting_errors() == []
        for rid, group in sched.groups.items():
            if bm.is_cross_compressed(group):
                sizes[rid] = (len(bm.get_cross_block_table(group)), bm.cross_positions(group), group.encoder_len)
    assert bm.num_free_blocks() == bm.num_total_blocks()  # every block back in the pool
    return [outs[str(i)] for i in range(len(prompts))], sizes


def test_compression_frees_blocks_and_keeps_the_pools_accounting():
    llm = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600, encoder_cache_blocks=0)
    outs, sizes = _run_steps(llm, LONG, SamplingParams(temperature=0.0, max_tokens=24))
    assert len(sizes) == len(LONG)  # every request was compressed
    for blocks, positions, enc in sizes.values():
        assert positions == min(enc, -(-max(1, -(-3 * enc // 10)) // 4) * 4)
        assert blocks == blocks_for(positions, 4) < blocks_for(enc, 4)
    assert llm.llm_engine.scheduler.cross_compress.blocks_freed == sum(
        blocks_for(e, 4) - b for b, _, e in sizes.values())
    assert all(o[0] for o in outs)


def test_forks_share_the_compressed_table():
    # n = 2 greedy copies: both read the one compressed table, so both equal the n = 1 run.
    one = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600)
    single, _ = _run_steps(one, LONG[:4], SamplingParams(temperature=0.0, max_tokens=24))
    two = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600)
    pairs, sizes = _run_steps(two, LONG[:4], SamplingParams(n=2, temperature=0.0, max_tokens=24))
    assert len(sizes) == 4
    assert pairs == [[s[0], s[0]] for s in single]


def test_beam_search_runs_over_the_compressed_table():
    from tandem import BeamSearchParams

    llm = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600)
    engine = llm.llm_engine
    outs = llm.beam_search(LONG[:3], BeamSearchParams(beam_width=3, max_tokens=16), use_tqdm=False)
    assert engine.scheduler.cross_compress.num_compressed == 3
    assert all(len(o.outputs) >= 1 and o.outputs[0].token_ids for o in outs)
    assert engine.block_manager.accounting_errors() == []
    assert engine.block_manager.num_free_blocks() == engine.block_manager.num_total_blocks()


@pytest.mark.slow  # two engines, 8 requests x 40 tokens each, a tight pool: > 10 s on a loaded 2-core machine
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_compression_working(mode):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600)
    want, _ = _run_steps(roomy, LONG, params)
    # A pool far too small for all eight at once: the scheduler preempts.
    tight = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=40, preemption_mode=mode, encoder_cache_blocks=0)
    got, sizes = _run_steps(tight, LONG, params)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert len(sizes) == len(LONG)
    if mode == "swap":  # the swapped blocks come back as they were: the same tokens
        assert got == want
    else:  # recompute re-observes and compresses again; decoding ends on every request
        assert all(len(o[0]) == 40 for o in got)
