"""Beam search's worker step batched over a step's requests (``BeamStep.prepare_all`` /
``select_all``) against HF's arithmetic computed one request at a time: each request's
rows log-softmaxed alone, its running scores added, one top-k over ``[1, beams *
vocab]``. Bit for bit: the batched calls must not change a score or a tie."""

from __future__ import annotations

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.core.strategies.beam import BeamStep

VOCAB = 300


def _hf_one_request(logits_rows: torch.Tensor, running: list[float], num_beams: int, keep: int):
    """HF's ``_beam_search`` step for one request (rows [beams or 1, vocab])."""
    logp = torch.log_softmax(logits_rows, dim=-1)
    if logp.shape[0] == 1:
        logp = logp.expand(num_beams, VOCAB)
    acc = (logp + torch.tensor(running)[:, None]).view(1, -1)
    values, idx = torch.topk(acc, keep)
    values, idx = values[0], idx[0]
    return values.tolist(), (idx // VOCAB).tolist(), (idx % VOCAB).tolist(), logp.reshape(-1)[idx].tolist()


def test_batched_beam_steps_equal_hf_one_request_at_a_time():
    g = torch.Generator().manual_seed(0)
    # Requests: (beams, first step?), with a plain row (greedy) between two of them.
    layout = [(4, False), (4, True), (2, False), None, (4, False), (3, False), (4, True)]
    logits_parts, items, row = [], [], 0
    for n, spec in enumerate(layout):
        if spec is None:
            logits_parts.append(torch.randn(1, VOCAB, generator=g) * 4)
            row += 1
            continue
        beams, first = spec
        nrows = 1 if first else beams
        x = torch.randn(nrows, VOCAB, generator=g) * 4
        x[:, 7] = x[:, 8]  # a tie inside each row
        logits_parts.append(x)
        running = [0.0] + [-1e9] * (beams - 1) if first else (-torch.rand(beams, generator=g) * 10).tolist()
        mode = BeamStep(running, beams, 2 * beams)
        params = SamplingParams(num_beams=beams, max_tokens=8, logprobs=2 if n == 2 else None)
        items.append((mode, list(range(row, row + nrows)), params))
        row += nrows
    logits = torch.cat(logits_parts)
    raw = logits.clone()

    prepared = BeamStep.prepare_all(logits, [(m, r) for m, r, _ in items])
    beam_rows = [i for _, r, _ in items for i in r]
    plain = [i for i in range(logits.shape[0]) if i not in beam_rows]
    assert torch.equal(logits[plain], raw[plain])  # the greedy row is left alone
    for _, rows, _ in items:
        assert torch.equal(logits[rows], torch.log_softmax(raw[rows], dim=-1))

    got = BeamStep.select_all(logits, [(m, r, p, prep, None) for (m, r, p), prep in zip(items, prepared)])
    for (mode, rows, params), cands in zip(items, got):
        values, parents, tokens, token_logprobs = _hf_one_request(raw[rows], mode.scores, mode.num_beams,
                                                                  mode.beams_to_keep)
        assert cands.scores == values
        assert cands.parents == (parents if len(rows) > 1 else [0] * len(parents))
        assert cands.token_ids == tokens
        assert cands.token_logprobs == token_logprobs
        if params.logprobs:
            vals, ids = torch.log_softmax(raw[rows], -1).topk(2)
            assert cands.top_logprobs == [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        # The single-request hook agrees with the batched one.
        assert mode.select(logits, rows, params, None) == cands


def test_a_step_of_beams_only_is_log_softmaxed_in_place():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, VOCAB, generator=g) * 4
    raw = logits.clone()
    modes = [BeamStep([0.0, -1.0, -2.0, -3.0], 4, 8) for _ in range(2)]
    BeamStep.prepare_all(logits, [(modes[0], [0, 1, 2, 3]), (modes[1], [4, 5, 6, 7])])
    assert torch.equal(logits, torch.log_softmax(raw, dim=-1))


def test_search_steps_stacked_over_requests_equal_each_alone():
    """``BeamSearchState.step_all`` over requests of mixed beam counts, length penalties,
    early stopping and stop ids, step after step: every request's scores (bit for bit),
    hypotheses, next beams and ``done`` equal what stepping it alone gives. Candidate
    scores come rounded to a coarse grid, so ties between candidates are common."""
    from tandem.core.strategies.beam.search import BeamCandidates, BeamSearchState

    g = torch.Generator().manual_seed(1)
    settings = [(4, 1.0, False), (4, 0.6, True), (2, 2.0, "never"), (4, -0.5, False), (3, 1.0, True),
                (4, 1.0, "never"), (2, 1.0, False)]

    def fresh():
        out = []
        for beams, lp, early in settings:
            p = SamplingParams(num_beams=beams, length_penalty=lp, early_stopping=early, max_tokens=6,
                               temperature=0.0)
            out.append(BeamSearchState(p, prompt_len=2, stop_ids=frozenset({2, 5})))
        return out

    together, alone = fresh(), fresh()
    outs = {id(st): [[]] * st.num_beams for st in together}
    outs_alone = {id(st): [[]] * st.num_beams for st in alone}
    for step in range(6):
        items, items_alone = [], []
        for a, b in zip(together, alone):
            if a.done:
                continue
            k = 2 * a.num_beams
            scores = (torch.randn(k, generator=g) * 2).round(decimals=1).sort(descending=True).values.tolist()
            cands = BeamCandidates(scores, torch.randint(0, a.num_beams, (k,), generator=g).tolist(),
                                   torch.randint(0, 8, (k,), generator=g).tolist(), [-0.1] * k)
            items.append((a, cands, outs[id(a)], [[] for _ in range(a.num_beams)], step))
            items_alone.append((b, cands, outs_alone[id(b)], [[] for _ in range(b.num_beams)], step))
        if not items:
            break
        stacked = BeamSearchState.step_all(items)
        singles = [BeamSearchState.step_all([it])[0] for it in items_alone]
        for (a, *_), (b, *_), x, y in zip(items, items_alone, stacked, singles):
            assert (x.parents, x.token_ids, x.scores) == (y.parents, y.token_ids, y.scores)
            assert (a.scores, a.is_finished, a.running) == (b.scores, b.is_finished, b.running)
            assert (a.done, a.improvable) == (b.done, b.improvable)
            assert [h and (h.output_token_ids, h.finished_by_stop) for h in a.hyps] == \
                [h and (h.output_token_ids, h.finished_by_stop) for h in b.hyps]
            outs[id(a)] = [outs[id(a)][p] + [t] for p, t in zip(x.parents, x.token_ids)]
            outs_alone[id(b)] = [outs_alone[id(b)][p] + [t] for p, t in zip(y.parents, y.token_ids)]
    assert any(st.done for st in together)


def _old_step(st, cands, parents_out, parents_logprobs, num_out):
    """The search step as it was before its state became lists and its hypotheses
    lazy (tensors per request, each hypothesis's lists copied at once): one request."""
    from tandem.core.strategies.beam.search import _NEG

    num_beams, k = st.num_beams, len(cands.scores)
    c = st.prompt_len + num_out
    topk = torch.tensor([cands.scores], dtype=torch.float32)
    ended = torch.tensor([[True] * k if c + 1 >= st.max_length
                          else [t in st.stop_ids for t in cands.token_ids]], dtype=torch.bool)
    running_cands = topk + ended.to(torch.float32) * _NEG
    next_idx = torch.topk(running_cands, k=num_beams, dim=1)[1]
    new_running = running_cands.gather(1, next_idx)
    top_mask = torch.zeros(1, k, dtype=torch.bool)
    top_mask[:, :num_beams] = True
    just_finished = ended & top_mask
    scores, is_finished = st.scores[None], st.is_finished[None]
    p = st.params
    finished_scores = topk / torch.tensor([[(c + 1 - st.prompt_len) ** p.length_penalty]], dtype=torch.float32)
    full = is_finished.all(dim=1, keepdim=True) & torch.tensor([[p.early_stopping is True]])
    finished_scores += full.to(torch.float32) * _NEG
    finished_scores += torch.tensor([[float(not st.improvable)]]) * _NEG
    finished_scores += (~just_finished) * _NEG
    merged_scores = torch.cat((scores, finished_scores), dim=1)
    merged_finished = torch.cat((is_finished, just_finished), dim=1)
    keep_t = torch.topk(merged_scores, k=num_beams, dim=1)[1]
    new_scores, new_finished = merged_scores.gather(1, keep_t), merged_finished.gather(1, keep_t)
    best_len = st.max_length - st.prompt_len if p.early_stopping == "never" and p.length_penalty > 0.0 \
        else c + 1 - st.prompt_len
    best_possible = new_running[:, :1] / torch.tensor([[best_len ** p.length_penalty]], dtype=torch.float32)
    worst = torch.where(new_finished, new_scores.amin(dim=1, keepdim=True), torch.tensor(_NEG))
    better = bool((best_possible > worst).any())
    hyps = []
    for m in keep_t[0].tolist():
        if m < num_beams:
            hyps.append(st.hyps[m])
            continue
        j, t = cands.parents[m - num_beams], cands.token_ids[m - num_beams]
        top = None
        if cands.top_logprobs is not None:
            top = dict(cands.top_logprobs[j])
            top[t] = cands.token_logprobs[m - num_beams]
        hyps.append((parents_out[j] + [t], parents_logprobs[j] + [top] if top is not None else [], t in st.stop_ids))
    st.scores, st.is_finished, st.hyps, st.running = new_scores[0], new_finished[0], hyps, new_running[0]
    st.improvable = st.improvable and better
    all_full = bool(new_finished.all()) and p.early_stopping is True
    st.done = not (st.improvable and not all_full and not bool(ended.all()))
    nx = next_idx[0].tolist()
    return [cands.parents[i] for i in nx], [cands.token_ids[i] for i in nx], running_cands[0, nx].tolist()


def test_search_steps_equal_the_tensor_state_and_eager_hypotheses_of_before():
    """``step_all`` (list state, hypotheses holding their parent's live lists) against the
    step as it was (``_old_step``), over beams whose token lists live on as a
    sequence's do: a beam's first continuation appends to its parent's list, a further
    one copies it first (``take_over``), so the hypotheses' parents keep growing
    after they are made. Scores, flags, next beams and every hypothesis, read at every
    step, equal. Candidates on a coarse grid (ties), stop ids, logprobs."""
    from types import SimpleNamespace

    from tandem.core.strategies.beam.search import BeamCandidates, BeamSearchState

    g = torch.Generator().manual_seed(5)
    settings = [(4, 1.0, False, None), (4, 0.6, True, 1), (2, 2.0, "never", None), (4, -0.5, False, 2),
                (3, 1.0, True, None), (4, 1.0, "never", 1), (2, 1.0, False, None)]
    new, old, lists = [], [], []
    for beams, lp, early, logprobs in settings:
        p = SamplingParams(num_beams=beams, length_penalty=lp, early_stopping=early, max_tokens=9,
                           temperature=0.0, logprobs=logprobs)
        st = BeamSearchState(p, prompt_len=3, stop_ids=frozenset({2, 5}))
        new.append(st)
        old.append(SimpleNamespace(
            params=p, num_beams=beams, prompt_len=3, max_length=3 + 9, stop_ids=st.stop_ids,
            running=torch.tensor(st.running, dtype=torch.float32), scores=torch.full((beams,), -1e9),
            is_finished=torch.zeros(beams, dtype=torch.bool), hyps=[None] * beams, improvable=True, done=False))
        lists.append(([[] for _ in range(beams)], [[] for _ in range(beams)]))
    for step in range(9):
        items, live = [], []
        for n, (a, b) in enumerate(zip(new, old)):
            assert a.done == b.done
            if a.done:
                continue
            k = 2 * a.num_beams
            outs, lps = lists[n]
            scores = (torch.randn(k, generator=g) * 2).round(decimals=1).sort(descending=True).values.tolist()
            tops = None
            if a.params.logprobs is not None:
                tops = [{int(t): -float(t) / 10 for t in torch.randint(0, 8, (2,), generator=g)}
                        for _ in range(a.num_beams)]
            cands = BeamCandidates(scores, torch.randint(0, a.num_beams, (k,), generator=g).tolist(),
                                   torch.randint(0, 8, (k,), generator=g).tolist(),
                                   (torch.randn(k, generator=g) * -1).tolist(), tops)
            items.append((a, cands, outs, lps, step))
            live.append((n, b, cands))
        if not items:
            break
        got = BeamSearchState.step_all(items)
        for (n, b, cands), beams, (a, *_) in zip(live, got, items):
            outs, lps = lists[n]
            parents, tokens, run = _old_step(b, cands, [list(o) for o in outs], [list(x) for x in lps], step)
            assert (beams.parents, beams.token_ids, beams.scores) == (parents, tokens, run)
            assert (a.scores, a.is_finished, a.running) == (b.scores.tolist(), b.is_finished.tolist(), b.running.tolist())
            assert (a.done, a.improvable) == (b.done, b.improvable)
            # The beams' lists as sequences' are: a parent's first continuation appends
            # to its list, a further one takes a copy of it (take_over), then appends.
            seen, new_outs, new_lps = set(), [], []
            for j in beams.parents:
                o, x = (outs[j], lps[j]) if j not in seen else (outs[j][:], lps[j][:])
                seen.add(j)
                new_outs.append(o)
                new_lps.append(x)
            for o, x, t, top in zip(new_outs, new_lps, beams.token_ids, beams.top_logprobs or [None] * len(new_outs)):
                o.append(t)
                if top is not None:
                    x.append(top)
            lists[n] = (new_outs, new_lps)
        for a, b in zip(new, old):  # every kept hypothesis, its parents grown since
            assert [h and (h.output_token_ids, h.output_logprobs, h.finished_by_stop) for h in a.hyps] == b.hyps
    assert all(st.done for st in new)
