"""Attention runs of one shape as one SDPA call (tandem/backends/sdpa_groups.py):
bit-equal to one call per run (encoder runs, causal prefills; cross prefills of
one or two queries to rounding), float64's result within float32 rounding, and
taken by the SDPA backends' encoder and prefill paths on CPU."""

import random

import pytest
import torch
import torch.nn.functional as F

from layouts import REL_FP32, Seq, check_backend, reference, relative_error, sdpa_family_backend
from tandem.backends import sdpa_groups
from tandem.backends.sdpa_groups import attend_runs

H, D = 4, 16


def _per_run(query, key, value, runs, *, scale, causal, gqa):
    """The path before grouping: one SDPA call per run over views."""
    out = torch.full_like(query, float("nan"))
    for qs, ql, ks, kl in runs:
        o = F.scaled_dot_product_attention(
            query[qs : qs + ql].transpose(0, 1)[None], key[ks : ks + kl].transpose(0, 1)[None],
            value[ks : ks + kl].transpose(0, 1)[None], is_causal=causal, scale=scale, enable_gqa=gqa)
        out[qs : qs + ql] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("case", ["encoder", "causal prefill", "cross", "gqa"])
@pytest.mark.parametrize("seed", range(3))
def test_grouped_runs_are_bit_equal_to_one_call_per_run_and_match_float64(case, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = 24
    # Shapes repeat (a few lengths for many runs), as in a batch of short requests;
    # one shape appears once, so a singleton group is in every case.
    lens = [rng.choice([3, 5, 9]) for _ in range(n - 1)] + [13]
    kv_heads = 2 if case == "gqa" else H
    runs, tq, k_rows = [], 0, 400
    for kl in lens:
        if case == "cross":  # one or two queries over keys at a scattered start
            ql = rng.choice([1, 2])
            runs.append((tq, ql, rng.randrange(0, k_rows - kl + 1), kl))
        else:  # keys are the queries' own rows
            ql = kl
            runs.append((tq, ql, tq, ql))
        tq += ql
    # The query a strided view (the q of one fused q/k/v projection), as in a model.
    qkv = torch.randn(tq, (H + 2 * kv_heads) * D, generator=g)
    query = qkv[:, : H * D].view(tq, H, D)
    if case == "cross":  # keys read from a cache's slots
        key, value = torch.randn(2, k_rows, kv_heads, D, generator=g)
    else:
        key = qkv[:, H * D : (H + kv_heads) * D].view(tq, kv_heads, D)
        value = qkv[:, (H + kv_heads) * D :].view(tq, kv_heads, D)
    causal, gqa, scale = case == "causal prefill", kv_heads != H, D**-0.5

    out = torch.full_like(query, float("nan"))
    # Runs of 13 keys attended alone through views (the rest gathered), as Whisper's
    # cross prefills over 1,500 positions are.
    max_gather = 12 * kv_heads * D
    attend_runs(query, key, value, runs, out, scale=scale, causal=causal, gqa=gqa, max_gather=max_gather)
    per_run = _per_run(query, key, value, runs, scale=scale, causal=causal, gqa=gqa)
    if case == "cross":
        # One or two queries over a few keys: with 2+ threads PyTorch's CPU kernel sums
        # such a call in another order than a batch of them (and than itself on one
        # thread), so only rounding may differ: <= L * u * max|v| ~ 13 * 6e-8 * 5 = 4e-6.
        assert torch.allclose(out, per_run, rtol=0, atol=5e-6)
    else:
        assert torch.equal(out, per_run)
    for qs, ql, ks, kl in runs:
        q, k, v = (t.double() for t in (query[qs : qs + ql], key[ks : ks + kl], value[ks : ks + kl]))
        want = reference(q, k, v, scale, causal_offset=0 if causal else None)
        assert relative_error(out[qs : qs + ql], want) < REL_FP32


def test_one_run_is_attended_in_place():
    query = torch.randn(7, H, D)
    out = torch.empty_like(query)
    attend_runs(query, query, query, [(0, 7, 0, 7)], out, scale=0.25, causal=True, gqa=False, max_gather=0)
    assert torch.equal(out, _per_run(query, query, query, [(0, 7, 0, 7)], scale=0.25, causal=True, gqa=False))


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_paged"])
def test_backend_groups_encoder_runs_and_prefills_of_one_shape(backend, monkeypatch):
    """A step of short requests: encoder runs of a few lengths, two-token prefills
    over contiguous cross tables. Each kind is attended through attend_runs in one
    call over all sequences, and every output is float64's (check_backend)."""
    cls = sdpa_family_backend(backend)
    import tandem.backends.torch_sdpa as sdpa

    calls = []
    real = sdpa_groups.attend_runs

    def spy(query, key, value, runs, out, *, scale, causal, gqa, max_gather, plan=None):
        calls.append((len(runs), causal))
        assert all(k_len * key.shape[1] * key.shape[2] <= max_gather for *_, k_len in runs)  # all gathered
        real(query, key, value, runs, out, scale=scale, causal=causal, gqa=gqa, max_gather=max_gather, plan=plan)

    monkeypatch.setattr(sdpa, "attend_runs", spy)
    block_size, seqs, used = 4, [], 0
    for group, n in enumerate([6, 9, 6, 9, 6, 11]):
        cross = list(range(used, used + -(-n // block_size)))  # contiguous: read through a view
        table = [cross[-1] + 1]
        used = table[-1] + 1
        seqs.append(Seq(group, 0, 2, table, n, cross, True))
    check_backend(cls, 0, block_size, num_kv_heads=2, layout=(seqs, used + 4))
    # Encoder runs, causal self prefills and cross prefills: every call takes all 6
    # sequences at once (check_backend runs some kinds more than once).
    assert {n for n, _ in calls} == {6} and {causal for _, causal in calls} == {False, True}


def _mixed_case(case, lens, seed):
    """Runs of ``lens`` (cross: one or two queries over keys at scattered starts)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kv_heads = 2 if case == "gqa" else H
    runs, tq, k_rows = [], 0, 400
    for kl in lens:
        ql = rng.choice([1, 2]) if case == "cross" else kl
        runs.append((tq, ql, rng.randrange(0, k_rows - kl + 1), kl) if case == "cross" else (tq, ql, tq, ql))
        tq += ql
    qkv = torch.randn(tq, (H + 2 * kv_heads) * D, generator=g)
    query = qkv[:, : H * D].view(tq, H, D)
    if case == "cross":
        key, value = torch.randn(2, k_rows, kv_heads, D, generator=g)
    else:
        key = qkv[:, H * D : (H + kv_heads) * D].view(tq, kv_heads, D)
        value = qkv[:, (H + kv_heads) * D :].view(tq, kv_heads, D)
    return query, key, value, runs, case == "causal prefill", kv_heads != H


LENGTHS = {
    "mixed": [1, 2, 7, 8, 9, 10, 15, 16, 17, 23, 30, 31, 32, 33, 47, 64, 9, 30, 17, 1],
    "short mixed": [rng_len for rng_len in random.Random(5).choices(range(10, 31), k=40)],
    "all equal": [12] * 9,
    "one long": [3, 5, 140, 9],
}


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("case", ["encoder", "causal prefill", "cross", "gqa"])
def test_padded_batches_match_one_call_per_run_and_float64(case, lengths, monkeypatch):
    """Runs of mixed lengths (1 included) padded into a few batches under a key mask:
    within float32 rounding of a call per run and of float64; every padded run's
    outputs written, nothing else; all-equal lengths stay bit-equal (no padding)."""
    monkeypatch.setattr(sdpa_groups, "PAD_MIXED_LENGTHS", True)
    query, key, value, runs, causal, gqa = _mixed_case(case, LENGTHS[lengths], seed=len(lengths))
    scale = D**-0.5
    sdpa_calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        sdpa_calls.append(args[0].shape)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(sdpa_groups.F, "scaled_dot_product_attention", counting)
    out = torch.full_like(query, float("nan"))
    attend_runs(query, key, value, runs, out, scale=scale, causal=causal, gqa=gqa, max_gather=1 << 30)
    shapes = {(sdpa_groups.padded_length(ql), sdpa_groups.padded_length(kl)) for _, ql, _, kl in runs}
    monkeypatch.undo()
    per_run = _per_run(query, key, value, runs, scale=scale, causal=causal, gqa=gqa)
    if lengths == "all equal" and case != "cross":
        assert torch.equal(out, per_run)
    assert torch.allclose(out, per_run, rtol=0, atol=5e-6)
    assert len(sdpa_calls) == len(shapes) <= len(runs)
    for qs, ql, ks, kl in runs:
        q, k, v = (t.double() for t in (query[qs : qs + ql], key[ks : ks + kl], value[ks : ks + kl]))
        want = reference(q, k, v, scale, causal_offset=0 if causal else None)
        assert relative_error(out[qs : qs + ql], want) < REL_FP32


@pytest.mark.parametrize("case", ["encoder", "cross"])
def test_a_plan_made_once_serves_every_layer_and_big_buckets_split(case, monkeypatch):
    """A plan (plan_runs) given to attend_runs gives what attend_runs makes itself;
    a bucket over MAX_BATCH_ELEMENTS is split into several calls; runs that leave
    rows of ``out`` alone (decodes in the step) write only their own rows."""
    monkeypatch.setattr(sdpa_groups, "PAD_MIXED_LENGTHS", True)
    monkeypatch.setattr(sdpa_groups, "MAX_BATCH_ELEMENTS", 3 * 32 * H * D)  # 3 runs of 32
    query, key, value, runs, causal, gqa = _mixed_case(case, LENGTHS["short mixed"], seed=1)
    runs = runs[:-1]  # the last run's rows stay NaN: not covered
    kw = dict(scale=D**-0.5, causal=causal, gqa=gqa, max_gather=1 << 30)
    plan = sdpa_groups.plan_runs(runs, num_queries=query.shape[0], per_key=key.shape[1] * key.shape[2],
                                 max_gather=1 << 30, causal=causal, device=query.device)
    assert plan.dst is not None and len(plan.calls) > 3
    made, given = (torch.full_like(query, float("nan")) for _ in range(2))
    attend_runs(query, key, value, runs, made, **kw)
    attend_runs(query, key, value, runs, given, **kw, plan=plan)
    assert torch.equal(made.nan_to_num(), given.nan_to_num())
    last = sum(ql for _, ql, _, _ in runs)
    assert torch.isnan(made[last:]).all() and not torch.isnan(made[:last]).any()
    per_run = _per_run(query, key, value, runs, scale=D**-0.5, causal=causal, gqa=gqa)
    assert torch.allclose(made[:last], per_run[:last], rtol=0, atol=5e-6)


def _plan_by_hand(runs, *, num_queries, per_key, max_gather, causal, pad_mixed, max_elements):
    """What plan_runs is to return, found run by run in plain Python from the module's
    rules: (alone, [(runs, q_len, k_len, key lengths or None)], q_rows, k_rows, src, dst)."""
    def padded(n):
        return n if not pad_mixed or n < sdpa_groups.EXACT_BELOW else -(-n // sdpa_groups.PAD) * sdpa_groups.PAD

    alone = [r for r in runs if r[3] * per_key > max_gather]
    buckets = {}
    for r in runs:
        if r[3] * per_key <= max_gather:
            buckets.setdefault((padded(r[1]), padded(r[3])), []).append(r)
    calls, q_rows, k_rows, real = [], [], [], []
    for (pq, pk), members in buckets.items():
        if len({(r[1], r[3]) for r in members}) == 1:
            pq, pk = members[0][1], members[0][3]
        per_call = max(1, max_elements // (max(pq, pk) * per_key))
        for i in range(0, len(members), per_call):
            chunk = members[i : i + per_call]
            masked = not causal and any(r[3] != pk for r in chunk)
            calls.append((len(chunk), pq, pk, [r[3] for r in chunk] if masked else None))
            for qs, ql, ks, kl in chunk:
                for j in range(pq):
                    q_rows.append(qs + min(j, ql - 1))
                    if j < ql:
                        real.append((len(q_rows) - 1, qs + j))
                k_rows += [ks + min(j, kl - 1) for j in range(pk)]
    src, dst = [s for s, _ in real], [d for _, d in real]
    if not alone and len(dst) == num_queries:
        by_row = [None] * num_queries
        for s, d in real:
            by_row[d] = s
        src, dst = by_row, None
    return alone, calls, q_rows, k_rows, src, dst


@pytest.mark.parametrize("pad_mixed", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_plan_rows_and_calls_match_a_run_by_run_reading(pad_mixed, seed, monkeypatch):
    """plan_runs builds its index tensors for all runs at once: they, the calls and their
    masks equal a plain-Python walk over the runs (encoder, causal and cross runs, some
    attended alone, buckets split by a small MAX_BATCH_ELEMENTS, runs covering every
    query row or leaving gaps)."""
    monkeypatch.setattr(sdpa_groups, "PAD_MIXED_LENGTHS", pad_mixed)
    rng = random.Random(seed)
    for trial in range(40):
        causal, gaps = rng.random() < 0.4, rng.random() < 0.5
        max_elements = rng.choice([1 << 24, 40 * 64])
        monkeypatch.setattr(sdpa_groups, "MAX_BATCH_ELEMENTS", max_elements)
        runs, row, key_row = [], 0, 0
        for _ in range(rng.randint(2, 30)):
            ql = rng.randint(1, 40)
            kl = ql if causal else rng.choice([rng.randint(1, 40), 300])  # 300 x 64 > max_gather: alone
            runs.append((row, ql, row if causal else key_row, kl))
            row += ql + (rng.randint(0, 2) if gaps else 0)
            key_row += kl + rng.randint(0, 3)
        kw = dict(num_queries=row, per_key=64, max_gather=16384, causal=causal)
        plan = sdpa_groups.plan_runs(runs, device=torch.device("cpu"), **kw)
        alone, calls, q_rows, k_rows, src, dst = _plan_by_hand(runs, pad_mixed=pad_mixed,
                                                               max_elements=max_elements, **kw)
        assert plan.alone == alone
        assert [(c.runs, c.q_len, c.k_len) for c in plan.calls] == [c[:3] for c in calls]
        for c, (b, _, pk, key_lens) in zip(plan.calls, calls):
            if key_lens is None:
                assert c.mask is None
            else:
                expected = torch.tensor([[j < n for j in range(pk)] for n in key_lens])[:, None, None, :]
                assert torch.equal(c.mask, expected)
        if not calls:
            assert plan.q_rows is None
            continue
        assert plan.q_rows.tolist() == q_rows and plan.k_rows.tolist() == k_rows
        assert plan.src.tolist() == src
        assert (plan.dst is None) == (dst is None) and (dst is None or plan.dst.tolist() == dst)
