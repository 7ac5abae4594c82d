"""Random paged layouts and a float64 reference: the conformance check every
attention backend runs (tests/backends/test_conformance.py), usable by a plugin's
own tests too: ``check_backend(MyBackend, seed=0, block_size=16, num_kv_heads=2)``."""

from __future__ import annotations

import random

import torch

from tandem.core.attention import AttentionBackend, AttentionType, KVCacheSpec
from tandem.core.inputs import EncoderInputs
from tandem.core.layers import Attention
from tandem.core.scheduler_output import ScheduledGroup, ScheduledSequence, SchedulerOutput
from tandem.core.worker.model_runner import ModelRunner

H, D = 4, 8
# float32 attention against float64 over O(1) random inputs: each output is a
# softmax-weighted mean of <= ~130 values after dot products of length 8; float32
# rounding (6e-8 per operation) stays well below 1e-5 absolute, and 2e-5 / 1e-4
# leaves room for a backend's own summation order (observed: ~1e-6).
ATOL, RTOL = 2e-5, 1e-4


def _take_blocks(rng, free, n, contiguous, num_blocks):
    if contiguous:
        start = rng.randrange(0, num_blocks - n)
        run = list(range(start, start + n))
        if all(b in free for b in run):
            for b in run:
                free.remove(b)
            return run
    return [free.pop() for _ in range(n)]


def random_layout(rng: random.Random, block_size: int):
    """Sequences with mixed work: prefill from 0 (with or without its encoder
    running now), a chunk on top of cached tokens, single-token decodes; cross
    tables contiguous or scattered."""
    specs = []
    for _ in range(rng.randint(1, 7)):
        ctx = rng.choice([0, 0, rng.randint(1, 40)])
        q_len = rng.choice([1, 1, rng.randint(1, 9)])
        run_encoder = ctx == 0 and rng.random() < 0.7
        specs.append((rng.randint(1, 120), ctx, q_len, run_encoder, rng.random() < 0.6))
    num_blocks = sum(-(-e // block_size) + -(-(c + q) // block_size) for e, c, q, *_ in specs) * 3 + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    groups, logical = [], []
    for gi, (enc_len, ctx, q_len, run_encoder, contiguous) in enumerate(specs):
        cross = _take_blocks(rng, free, -(-enc_len // block_size), contiguous, num_blocks)
        table = [free.pop() for _ in range(-(-(ctx + q_len) // block_size))]
        seq = ScheduledSequence(gi, list(range(q_len)), ctx, table, True, 0)
        enc = EncoderInputs.from_token_ids([1] * enc_len) if run_encoder else None
        groups.append(ScheduledGroup(str(gi), [seq], enc, enc_len, cross))
        logical.append(dict(enc_len=enc_len, ctx=ctx, q_len=q_len, table=table, cross=cross, run_encoder=run_encoder))
    out = SchedulerOutput(scheduled=groups, num_batched_tokens=0, blocks_to_swap_in=[], blocks_to_swap_out=[])
    return out, logical, num_blocks


def slots(table: list[int], n: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def reference(q, k, v, causal_offset=None):
    """float64 attention of q [q_len, H, D] over k, v [L, KVH, D] (KV heads repeated for GQA)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    if causal_offset is not None:
        qpos = torch.arange(q.shape[0])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def check_backend(backend: type[AttentionBackend], seed: int, block_size: int, num_kv_heads: int) -> None:
    """Run the three attention kinds through ``backend`` (its metadata builder, its
    impl behind the ``Attention`` layer, caches from its own ``allocate_kv_cache``)
    on a random layout, and compare with float64 computed from the dense K/V."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out, logical, num_blocks = random_layout(rng, block_size)
    cpu = torch.device("cpu")
    builder = backend.get_metadata_builder_cls()(block_size, cpu, KVCacheSpec(1, num_kv_heads, D))
    md = builder.build(ModelRunner(None, builder, block_size, cpu).prepare(out))
    layers = {t: Attention(H, D, D**-0.5, backend, t, num_kv_heads) for t in AttentionType}
    self_cache, cross_cache = (
        backend.allocate_kv_cache(num_blocks, block_size, num_kv_heads, D, torch.float32, cpu) for _ in range(2)
    )
    assert backend.kv_cache_block_bytes(block_size, num_kv_heads, D, torch.float32) * num_blocks == (
        self_cache.numel() * self_cache.element_size()
    )

    def rand(n, heads):
        return torch.randn(n, heads, D, generator=g, dtype=torch.float64)

    qs, k_new, v_new, ck_new, cv_new, want_self, want_cross = [], [], [], [], [], [], []
    enc, want_enc = [], []
    for lg in logical:
        total = lg["ctx"] + lg["q_len"]
        k, v, q = rand(total, num_kv_heads), rand(total, num_kv_heads), rand(lg["q_len"], H)
        ck, cv = rand(lg["enc_len"], num_kv_heads), rand(lg["enc_len"], num_kv_heads)
        impl = layers[AttentionType.DECODER].impl
        # Cached context (and cross K/V of encoders that ran before) through the backend's own write.
        impl.write_kv_cache(k[: lg["ctx"]].float(), v[: lg["ctx"]].float(), self_cache,
                            slots(lg["table"], total, block_size)[: lg["ctx"]])
        if lg["run_encoder"]:
            ck_new.append(ck), cv_new.append(cv)
            eq, ek, ev = rand(lg["enc_len"], H), rand(lg["enc_len"], num_kv_heads), rand(lg["enc_len"], num_kv_heads)
            enc.append((eq, ek, ev)), want_enc.append(reference(eq, ek, ev))
        else:
            impl.write_kv_cache(ck.float(), cv.float(), cross_cache, slots(lg["cross"], lg["enc_len"], block_size))
        qs.append(q), k_new.append(k[lg["ctx"]:]), v_new.append(v[lg["ctx"]:])
        want_self.append(reference(q, k, v, causal_offset=lg["ctx"]))
        want_cross.append(reference(q, ck, cv))

    def flat(ts):
        return torch.cat(ts).float().flatten(1)

    q = flat(qs)
    got = layers[AttentionType.DECODER](q, flat(k_new), flat(v_new), self_cache, md)
    torch.testing.assert_close(got.double(), torch.cat(want_self).flatten(1), atol=ATOL, rtol=RTOL)
    ck = flat(ck_new) if ck_new else None
    cv = flat(cv_new) if cv_new else None
    got = layers[AttentionType.ENCODER_DECODER](q, ck, cv, cross_cache, md)
    torch.testing.assert_close(got.double(), torch.cat(want_cross).flatten(1), atol=ATOL, rtol=RTOL)
    if enc:
        eq, ek, ev = (flat([e[i] for e in enc]) for i in range(3))
        got = layers[AttentionType.ENCODER](eq, ek, ev, torch.empty(0), md)
        torch.testing.assert_close(got.double(), torch.cat(want_enc).flatten(1), atol=ATOL, rtol=RTOL)
    # A second decoder pass over the same step reads back what the first wrote.
    got = layers[AttentionType.DECODER](q, flat(k_new), flat(v_new), self_cache, md)
    torch.testing.assert_close(got.double(), torch.cat(want_self).flatten(1), atol=ATOL, rtol=RTOL)
