"""kv_compress per head (the ``cross_kv_compress_per_head`` feature): the budget rule, the
per-head read against float64 over each head's kept set (alone and in a batch with an
uncompressed request), the blocks freed, and the uniform layout for a backend without
the feature."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.attention import AttentionType, KVCacheSpec
from tandem.core.kv.block_pool import blocks_for
from tandem.core.kv_compress_config import PER_HEAD_FEATURE
from tandem.core.layers import Attention
from tandem.core.scheduler_output import CrossRepack
from tandem.core.worker import cross_compress
from tandem.core.worker.cross_compress import CrossKVCompressor
from tests.backends.layouts import Seq, reference, step_inputs
from tests.core.test_kv_compress import DEMO_BART, LONG, SMALL, _backends, _run_steps

LAYERS, KV_HEADS, HEADS, D, BS, N_ENC, K = 2, 2, 4, 8, 4, 37, 12


def _scores(g: torch.Generator) -> torch.Tensor:
    """[layers, kv_heads, N_ENC]: layer 0 head 0 concentrated on positions 5, 9 and 30
    (0.5, 0.3, 0.2 of its mass, ~1e-4 on the rest); every other head diffuse."""
    scores = 1.0 + torch.rand(LAYERS, KV_HEADS, N_ENC, generator=g)
    scores[0, 0] = 1e-6
    scores[0, 0, 5], scores[0, 0, 9], scores[0, 0, 30] = 0.5, 0.3, 0.2
    return scores


def _even(n: int) -> list[int]:
    return [round(i * (N_ENC - 1) / (n - 1)) for i in range(n)] if n > 1 else [0]


def test_a_concentrated_head_keeps_what_covers_95_percent_and_its_neighbours_the_rest():
    comp = CrossKVCompressor(LAYERS, KV_HEADS, BS, per_head=True, min_keep=2)
    comp.scores["r"] = {(0, 0): _scores(torch.Generator().manual_seed(0))}
    kept = comp.kept_per_head(CrossRepack("r", list(range(10)), N_ENC, [0, 1, 2], K))
    assert kept[0][0].tolist() == [5, 9, 30]  # 0.5 + 0.3 < 0.95 <= 0.5 + 0.3 + 0.2
    assert kept[0][1].tolist() == _even(2 * K - 3)  # the layer's budget, less head 0's
    assert [kept[1][h].tolist() for h in range(KV_HEADS)] == [_even(K)] * KV_HEADS  # as the uniform layout


def test_a_layer_below_the_largest_fills_the_tables_spare_slots():
    # Layer 1 (one concentrated head, one diffuse) uses its whole budget, 2 x 12 slots;
    # layer 0's two concentrated heads need 3 each, and fill the 18 slots left in the
    # table with their next most attended positions: 12 each.
    scores = _scores(torch.Generator().manual_seed(0))
    scores[1], scores[0, 1] = scores[0], scores[0, 0].roll(7)
    scores[0, :, 20:32] += torch.linspace(1e-5, 2e-5, 12)  # the next most attended after the three
    comp = CrossKVCompressor(LAYERS, KV_HEADS, BS, per_head=True, min_keep=2)
    comp.scores["r"] = {(0, 0): scores}
    kept = comp.kept_per_head(CrossRepack("r", list(range(10)), N_ENC, [0, 1, 2], K))
    assert [len(p) for p in kept[1]] == [3, 2 * K - 3]
    for h in range(KV_HEADS):
        assert kept[0][h].tolist() == scores[0, h].topk(K).indices.sort().values.tolist()


def _layout(backend, g, in_place):
    caches = [backend.allocate_kv_cache(48, BS, KV_HEADS, D, torch.float32, "cpu") for _ in range(LAYERS)]
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g))
    src = [40, 3, 17, 8, 22, 31, 5, 12, 29, 44]  # 10 blocks hold 37 positions
    dst = src[:3] if in_place else [11, 45, 2]  # 3 blocks of 4 x 2 single-head slots: 2 x 12 per layer
    original = [c.clone().double() for c in caches]
    comp = CrossKVCompressor(LAYERS, KV_HEADS, BS, per_head=True, min_keep=2)
    comp.scores["r"] = {(0, 0): _scores(g)}
    kept = comp.repack(CrossRepack("r", src, N_ENC, dst, K), caches)
    return caches, original, src, dst, kept, comp.layouts["r"]


def _want(original, src, positions, layer, h, qh, scale):
    """float64 attention of ``qh`` (query heads of KV head ``h``) over ``positions``'s
    K/V, read from the uncompressed cache."""
    flat = original[layer].view(2, -1, KV_HEADS, D)
    table, pos = torch.tensor(src), torch.as_tensor(positions)
    slots = table[pos // BS] * BS + pos % BS
    return reference(qh.double(), flat[0, slots, h][:, None], flat[1, slots, h][:, None], scale)


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("q_len", [1, 3])  # a decode and a prefill (verified draft tokens)
@pytest.mark.parametrize("in_place", [False, True], ids=["new_blocks", "in_place"])
def test_per_head_read_equals_float64_over_each_heads_kept_set_beside_an_uncompressed_request(
        backend, q_len, in_place):
    assert PER_HEAD_FEATURE in backend.capabilities.attn_features
    g = torch.Generator().manual_seed(1)
    caches, original, src, dst, kept, (offsets, lens) = _layout(backend, g, in_place)
    assert lens.tolist() == [[3, 2 * K - 3], [K, K]]
    # One batch: the compressed request, then an uncompressed one (its own 10 blocks).
    plain = [13, 14, 15, 16, 18, 19, 20, 21, 23, 24]
    seqs = [Seq(group=0, ctx=2, q_len=q_len, table=[0, 1], enc_len=K, cross=dst, run_encoder=False),
            Seq(group=1, ctx=3, q_len=q_len, table=[6, 7], enc_len=N_ENC, cross=plain, run_encoder=False)]
    inputs = step_inputs(seqs, BS)
    inputs.cross_per_head_seqs = [0]
    inputs.cross_head_offsets, inputs.cross_head_lens = offsets[None], lens[None]
    md = backend.get_metadata_builder_cls()(BS, torch.device("cpu"), KVCacheSpec(LAYERS, KV_HEADS, D)).build(inputs)
    for layer in range(LAYERS):
        attn = Attention(HEADS, D, 0.35, backend, AttentionType.ENCODER_DECODER, num_kv_heads=KV_HEADS)
        attn.impl.layer_index = layer
        q = torch.randn(2 * q_len, HEADS * D, generator=g)
        out = attn(q, None, None, caches[layer], md).view(2 * q_len, HEADS, D)
        qs = q.view(2 * q_len, HEADS, D)
        for h in range(KV_HEADS):
            heads = slice(2 * h, 2 * h + 2)
            want = _want(original, src, kept[layer][h], layer, h, qs[:q_len, heads], 0.35)
            torch.testing.assert_close(out[:q_len, heads].double(), want, atol=2e-5, rtol=1e-4)
            # The uncompressed request reads all 37 positions of its table, untouched.
            flat = caches[layer].double().view(2, -1, KV_HEADS, D)
            pos = torch.arange(N_ENC)
            slots = torch.tensor(plain)[pos // BS] * BS + pos % BS
            want = reference(qs[q_len:, heads].double(), flat[0, slots, h][:, None], flat[1, slots, h][:, None], 0.35)
            torch.testing.assert_close(out[q_len:, heads].double(), want, atol=2e-5, rtol=1e-4)


def test_blocks_freed_equal_the_largest_layers_kept_slots(every_head_concentrated, monkeypatch):
    llm = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600, encoder_cache_blocks=0)
    worker = llm.llm_engine.executor.rank_worker.worker
    assert worker.cross_compress.per_head
    layouts = {}
    real_repack = worker.cross_compress._repack_per_head

    def keep_layout(repack, caches, per_head):  # the layouts outlive the requests here
        kept = real_repack(repack, caches, per_head)
        layouts[repack.request_id] = worker.cross_compress.layouts[repack.request_id]
        return kept

    monkeypatch.setattr(worker.cross_compress, "_repack_per_head", keep_layout)
    outs, sizes = _run_steps(llm, LONG, SamplingParams(temperature=0.0, max_tokens=24))
    assert len(sizes) == len(LONG) == len(layouts)
    spec, config = worker.kv_spec, llm.llm_engine.scheduler.cross_compress.config
    freed = 0
    for rid, (blocks, _, enc) in sizes.items():
        offsets, lens = layouts[rid]
        assert (offsets == lens.cumsum(-1) - lens).all() and (lens >= 1).all()
        want = -(-int(lens.sum(-1).max()) // (4 * spec.num_kv_heads))  # ceil(max_l total_l / (bs x Hkv))
        assert blocks == want < blocks_for(config.kept_positions(enc, 4), 4)  # fewer than one count per request
        # every layer fills the table's slots (or keeps all its positions)
        assert ((lens.sum(-1) == blocks * 4 * spec.num_kv_heads) | (lens == enc).all(-1)).all()
        freed += blocks_for(enc, 4) - blocks
    assert llm.llm_engine.scheduler.cross_compress.blocks_freed == freed
    assert all(o[0] for o in outs)


def test_a_backend_without_the_feature_keeps_one_count_per_request(monkeypatch):
    from dataclasses import replace

    from tandem.backends.torch_sdpa import TorchSDPABackend

    caps = TorchSDPABackend.capabilities
    monkeypatch.setattr(TorchSDPABackend, "capabilities",
                        replace(caps, attn_features=caps.attn_features - {PER_HEAD_FEATURE}))
    llm = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600, encoder_cache_blocks=0, attention_backend="torch_sdpa")
    worker = llm.llm_engine.executor.rank_worker.worker
    assert not worker.cross_compress.per_head
    repacked = []
    real = worker.cross_compress.kept_positions
    monkeypatch.setattr(worker.cross_compress, "kept_positions",
                        lambda r, dev: repacked.append(r.request_id) or real(r, dev))
    _, sizes = _run_steps(llm, LONG[:4], SamplingParams(temperature=0.0, max_tokens=16))
    assert sorted(repacked) == sorted(sizes) and len(sizes) == 4  # the uniform re-pack, every request
    assert worker.cross_compress.layouts == {}
    config = llm.llm_engine.scheduler.cross_compress.config
    for blocks, positions, enc in sizes.values():
        assert positions == config.kept_positions(enc, 4) and blocks == blocks_for(positions, 4)


@pytest.fixture
def every_head_concentrated(monkeypatch):
    """Every head judged concentrated and static (covering half its window attention), so
    tables are trimmed below the uniform count."""
    monkeypatch.setattr(cross_compress, "CONCENTRATED", 0.5)
    monkeypatch.setattr(cross_compress, "_static", lambda seen: torch.ones((), dtype=torch.bool))


def test_speculation_verifies_drafts_over_trimmed_per_head_tables(every_head_concentrated):
    # Verified draft tokens read the cross table as a prefill does: greedy speculation
    # gives the tokens of plain decoding over the same compressed tables.
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want, _ = _run_steps(LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600), LONG, params)
    spec = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    got, sizes = _run_steps(spec, LONG, params)
    assert len(sizes) == len(LONG) and got == want


@pytest.mark.slow  # two engines, 8 requests x 40 tokens each, a tight pool: > 10 s on a loaded 2-core machine
def test_swap_preemption_brings_trimmed_per_head_tables_back(every_head_concentrated):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want, _ = _run_steps(LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600), LONG, params)
    tight = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=40, preemption_mode="swap", encoder_cache_blocks=0)
    got, sizes = _run_steps(tight, LONG, params)
    assert tight.llm_engine.scheduler.num_preemptions > 0 and len(sizes) == len(LONG)
    assert got == want


def test_heads_all_at_the_one_count_take_the_ordinary_layout(monkeypatch):
    """Where no head keeps fewer than the one count (the Whisper demo's moving heads), the
    per-head re-pack writes the ordinary layout: no per-head read, no trimming, and the
    same kept positions and tokens as a backend without the per-head feature."""
    from dataclasses import replace

    from tandem.backends.cpu_paged.backend import CPUPagedBackend

    def run(per_head: bool):
        caps = CPUPagedBackend.capabilities
        with monkeypatch.context() as m:
            if not per_head:
                m.setattr(CPUPagedBackend, "capabilities",
                          replace(caps, attn_features=caps.attn_features - {PER_HEAD_FEATURE}))
            llm = LLM(model=str(DEMO_BART), **SMALL, num_kv_blocks=600, encoder_cache_blocks=0,
                      attention_backend="cpu_paged")
            worker = llm.llm_engine.executor.rank_worker.worker
            assert worker.cross_compress.per_head == per_head
            # No head concentrated: every head keeps the one count, evenly spaced.
            m.setattr("tandem.core.worker.cross_compress.CONCENTRATED", 2.0)
            per_head_layouts = []
            real = worker.cross_compress._repack_per_head
            m.setattr(worker.cross_compress, "_repack_per_head",
                      lambda *a: per_head_layouts.append(a[0].request_id) or real(*a))
            outs, sizes = _run_steps(llm, LONG[:4], SamplingParams(temperature=0.0, max_tokens=16))
            return outs, sizes, per_head_layouts

    outs, sizes, per_head_layouts = run(True)
    want_outs, want_sizes, _ = run(False)
    assert per_head_layouts == [] and len(sizes) == 4
    assert sizes == want_sizes and outs == want_outs
