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
            assert torch.equal(a.scores, b.scores) and torch.equal(a.is_finished, b.is_finished)
            assert torch.equal(a.running, b.running)
            assert (a.done, a.improvable) == (b.done, b.improvable)
            assert [h and (h.output_token_ids, h.finished_by_stop) for h in a.hyps] == \
                [h and (h.output_token_ids, h.finished_by_stop) for h in b.hyps]
            outs[id(a)] = [outs[id(a)][p] + [t] for p, t in zip(x.parents, x.token_ids)]
            outs_alone[id(b)] = [outs_alone[id(b)][p] + [t] for p, t in zip(y.parents, y.token_ids)]
    assert any(st.done for st in together)
