"""The SDPA backend against a float64 reference on random paged layouts."""

import random

import pytest
import torch

from tandem.backends.kv_cache import write_to_paged_cache
from tandem.backends.torch_sdpa import TorchSDPABackend, contiguous_starts
from tandem.core.attention import AttentionType, KVCacheSpec
from tandem.core.model_runner import ModelRunner
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup, SequenceGroupMetadata

H, D = 4, 8


def _layout(rng: random.Random, block_size: int, num_blocks: int, specs):
    """Random block tables; some cross tables contiguous, the rest scattered."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    metas, logical = [], []
    for gi, (enc_len, ctx, q_len, run_encoder, contiguous) in enumerate(specs):
        n_cross = -(-enc_len // block_size)
        if contiguous:
            start = rng.randrange(0, num_blocks - n_cross)
            run = list(range(start, start + n_cross))
            if any(b not in free for b in run):
                run = [free.pop() for _ in range(n_cross)]
            else:
                for b in run:
                    free.remove(b)
        else:
            run = [free.pop() for _ in range(n_cross)]
        seq = Sequence(gi, list(range(ctx + q_len)))
        seq.num_computed_tokens = ctx
        self_table = [free.pop() for _ in range(-(-(ctx + q_len) // block_size))]
        group = SequenceGroup(str(gi), Sequence(1000 + gi, [1] * enc_len), [seq], SamplingParams(), 0.0)
        metas.append(
            SequenceGroupMetadata(str(gi), run_encoder, [seq], {seq.seq_id: self_table}, [1] * enc_len, run, group)
        )
        logical.append(dict(enc_len=enc_len, ctx=ctx, q_len=q_len, self_table=self_table, cross_table=run))
    return metas, logical


def _slots(table, n, bs):
    pos = torch.arange(n)
    return torch.tensor(table)[pos // bs] * bs + pos % bs


def _ref(q, k, v, causal_offset=None):
    """float64 attention of q [q_len, H, D] over k, v [L, H, D]."""
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    if causal_offset is not None:
        qpos = torch.arange(q.shape[0])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("cross_path", ["views", "gather"])
def test_all_three_attention_kinds_match_float64(seed, block_size, cross_path, monkeypatch):
    import tandem.backends.torch_sdpa as sdpa

    # Force every contiguous cross table through a cache view, or none.
    monkeypatch.setattr(sdpa, "VIEW_MIN_CROSS_ELEMENTS", 1 if cross_path == "views" else 10**12)
    rng = random.Random(seed)
    specs = []
    for _ in range(rng.randint(1, 7)):
        ctx = rng.choice([0, 0, rng.randint(1, 40)])
        q_len = rng.choice([1, 1, rng.randint(1, 9)])
        run_encoder = ctx == 0 and rng.random() < 0.7
        specs.append((rng.randint(1, 120), ctx, q_len, run_encoder, rng.random() < 0.6))
    num_blocks = sum(-(-e // block_size) + -(-(c + q) // block_size) for e, c, q, *_ in specs) * 3 + 8
    metas, logical = _layout(rng, block_size, num_blocks, specs)
    builder = TorchSDPABackend.get_metadata_builder_cls()(block_size, torch.device("cpu"), KVCacheSpec(1, H, D))
    inputs, _ = ModelRunner(None, builder, block_size, torch.device("cpu")).prepare(metas)
    md = builder.build(inputs)
    contiguous_decodes = [
        i for i, (q, start) in enumerate(zip(inputs.query_lens, md.cross_view_start)) if q == 1 and start >= 0
    ]
    assert len(md.decode_cross_views) == (len(contiguous_decodes) if cross_path == "views" else 0)
    impl = TorchSDPABackend.get_impl_cls()(H, D, D**-0.5, H)
    g = torch.Generator().manual_seed(seed)
    self_cache = torch.zeros(2, num_blocks, block_size, H, D)
    cross_cache = torch.zeros(2, num_blocks, block_size, H, D)

    q_rows, k_new, v_new, expect_self, expect_cross = [], [], [], [], []
    enc_q, enc_k, enc_v, expect_enc = [], [], [], []
    for lg in logical:
        total = lg["ctx"] + lg["q_len"]
        k = torch.randn(total, H, D, generator=g, dtype=torch.float64)
        v = torch.randn(total, H, D, generator=g, dtype=torch.float64)
        ck = torch.randn(lg["enc_len"], H, D, generator=g, dtype=torch.float64)
        cv = torch.randn(lg["enc_len"], H, D, generator=g, dtype=torch.float64)
        q = torch.randn(lg["q_len"], H, D, generator=g, dtype=torch.float64)
        # Context tokens are already cached; the new ones arrive as key/value.
        write_to_paged_cache(k[: lg["ctx"]].float(), v[: lg["ctx"]].float(), self_cache,
                             _slots(lg["self_table"], total, block_size)[: lg["ctx"]])
        write_to_paged_cache(ck.float(), cv.float(), cross_cache, _slots(lg["cross_table"], lg["enc_len"], block_size))
        q_rows.append(q)
        k_new.append(k[lg["ctx"]:])
        v_new.append(v[lg["ctx"]:])
        expect_self.append(_ref(q, k, v, causal_offset=lg["ctx"]))
        expect_cross.append(_ref(q, ck, cv))
    for meta, lg in zip(metas, logical):
        if meta.run_encoder:
            n = lg["enc_len"]
            eq, ek, ev = (torch.randn(n, H, D, generator=g, dtype=torch.float64) for _ in range(3))
            enc_q.append(eq), enc_k.append(ek), enc_v.append(ev)
            expect_enc.append(_ref(eq, ek, ev))

    q = torch.cat(q_rows).float()
    kn, vn = torch.cat(k_new).float(), torch.cat(v_new).float()
    write_to_paged_cache(kn, vn, self_cache, md.slot_mapping)
    got_self = impl.forward(q, kn, vn, self_cache, md, AttentionType.DECODER)
    torch.testing.assert_close(got_self.double(), torch.cat(expect_self), atol=2e-5, rtol=1e-4)
    got_cross = impl.forward(q, None, None, cross_cache, md, AttentionType.ENCODER_DECODER)
    torch.testing.assert_close(got_cross.double(), torch.cat(expect_cross), atol=2e-5, rtol=1e-4)
    if enc_q:
        eq, ek, ev = (torch.cat(t).float() for t in (enc_q, enc_k, enc_v))
        got_enc = impl.forward(eq, ek, ev, torch.empty(0), md, AttentionType.ENCODER)
        torch.testing.assert_close(got_enc.double(), torch.cat(expect_enc), atol=2e-5, rtol=1e-4)


def test_contiguous_starts():
    tables = torch.tensor([[4, 5, 6], [4, 6, 0], [9, 0, 0], [2, 3, 7]])
    lens = torch.tensor([12, 5, 3, 8])  # block size 4: 3, 2, 1, 2 blocks used
    assert contiguous_starts(tables, lens, 4).tolist() == [16, -1, 36, 8]
