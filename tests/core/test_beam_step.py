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
