"""The sampler's draws against the exact distribution HF's warpers define.

Each step is one batch that mixes greedy rows, a beam group and sampled rows
of many settings, each setting with its own ``SamplingParams`` and its own
logits, so a row that took another row's values (or a stage that ignored a
value, as top-p did after top-k) shows as draws outside the exact support or
as frequencies beyond the bound derived in ``distribution.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from distribution import FALSE_FAILURE, assert_draws_follow, assert_support_stable, hf_probs
from tandem import SamplingParams
from tandem.core.worker.logits_processors import ProcessorRows
from tandem.core.strategies.beam import BeamStep
from tandem.core.worker.sampler import Sampler
from tandem.core.worker.warpers import sampling_probs

VOCAB = 300
PROMPT = [2, 0]
HISTORY = PROMPT + [5, 9, 5, 17, 5, 40, 9]  # decoder prompt + output tokens so far

# name -> (SamplingParams fields, std of the setting's random logits). The spreads
# give supports from a handful of tokens to most of the vocabulary.
SETTINGS = {
    "temperature": (dict(temperature=0.7), 1.0),
    "temperature>1": (dict(temperature=1.6), 2.0),
    "top_k": (dict(temperature=0.7, top_k=12), 1.0),
    "top_p": (dict(temperature=0.7, top_p=0.85), 0.6),
    "top_p, temperature 1": (dict(top_p=0.6), 2.0),
    "min_p": (dict(temperature=0.7, min_p=0.1), 1.0),
    "top_k+top_p": (dict(temperature=0.7, top_k=12, top_p=0.85), 1.0),
    "top_k+min_p": (dict(temperature=0.9, top_k=30, min_p=0.2), 1.5),
    "top_p+min_p": (dict(temperature=0.9, top_p=0.9, min_p=0.25), 1.5),
    "all": (dict(temperature=1.3, top_k=40, top_p=0.8, min_p=0.05), 2.0),
    "penalties+bias": (
        dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.5, presence_penalty=0.7,
             frequency_penalty=0.4, logit_bias={5: 2.0, 9: -1.0, 3: 1.5, 100: 1.0}),
        0.6,
    ),
}


def _logits(seed: int, std: float) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * std


def _hf_processed(scores: torch.Tensor, fields: dict) -> torch.Tensor:
    """The processed scores for a row with ``HISTORY``: HF's own processors where HF
    has one (sequence bias, then repetition penalty, HF's order), then OpenAI's
    presence / frequency penalties over the output tokens, computed here."""
    x = scores.clone()[None]
    ids = torch.tensor([HISTORY])
    if fields.get("logit_bias"):
        bias = {(t,): b for t, b in fields["logit_bias"].items()}
        x = SequenceBiasLogitsProcessor(sequence_bias=bias)(ids, x)
    if fields.get("repetition_penalty", 1.0) != 1.0:
        x = RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"])(ids, x)
    penalized = _openai_penalties(x[0].double().tolist(), HISTORY[len(PROMPT):], fields.get("presence_penalty", 0.0),
                                  fields.get("frequency_penalty", 0.0))
    return torch.tensor(penalized, dtype=torch.float64).float()


def _openai_penalties(scores: list[float], output: list[int], presence: float, frequency: float) -> list[float]:
    """OpenAI's documented penalties (API reference, "Frequency and presence penalties"),
    token by token in Python floats: ``mu[j] - c[j] * frequency - (c[j] > 0) * presence``, where
    ``c[j]`` counts how often token j was generated before (the output, not the prompt)."""
    counts = Counter(output)
    return [mu - counts[j] * frequency - (presence if counts[j] > 0 else 0.0) for j, mu in enumerate(scores)]


def _warp_fields(fields: dict) -> dict:
    return {k: fields[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in fields}


@pytest.fixture(scope="module")
def cases():
    out = {}
    for j, (name, (fields, std)) in enumerate(SETTINGS.items()):
        raw = _logits(100 + j, std)
        processed = _hf_processed(raw, fields)
        probs_fn = lambda s, f=fields: hf_probs(s, **_warp_fields(f))  # noqa: E731
        # float32 rounding moves tandem's processed scores from HF's by ~1e-6.
        assert_support_stable(probs_fn, processed, eta=1e-4)
        out[name] = (SamplingParams(**fields), raw, probs_fn(processed))
    return out


def _run(cases, steps: int, per_setting: int, seeded: bool, n_per_seed: int = 50):
    """Draws ``steps x per_setting`` tokens per setting; also asserts greedy and beam rows."""
    names = list(cases)
    greedy = SamplingParams(temperature=0.0)
    beam = SamplingParams(temperature=0.0, num_beams=2)
    greedy_logits = _logits(7, 1.0)
    beam_logits = torch.stack([_logits(8, 1.0), _logits(9, 1.0)])
    sampler = Sampler(eos_token_ids=[2], seed=1234)
    gens = {}
    drawn = {name: [] for name in names}
    hist = torch.tensor([HISTORY])
    for _ in range(steps):
        params, logits, generators, owner = [], [], [], []
        for r in range(per_setting):  # settings interleaved row by row
            for j, name in enumerate(names):
                p, raw, _ = cases[name]
                params.append(p)
                logits.append(raw)
                owner.append(name)
                if seeded:
                    key = (name, r // n_per_seed)  # n_per_seed rows share a request's generator
                    if key not in gens:
                        gens[key] = torch.Generator().manual_seed(10_000 * j + r // n_per_seed)
                    generators.append(gens[key])
                else:
                    generators.append(None)
        beam_start = len(params)
        for k in range(2):
            params.append(beam)
            logits.append(beam_logits[k])
            owner.append("beam")
            generators.append(None)
        params.append(greedy)
        logits.append(greedy_logits)
        owner.append("greedy")
        generators.append(None)
        s = len(params)
        rows = ProcessorRows(
            params, [len(HISTORY) - len(PROMPT)] * s, [len(HISTORY)] * s,
            lambda idx: (hist.expand(len(idx), -1), torch.full((len(idx),), len(HISTORY))),
        )
        mode, beam_rows = BeamStep([-1.0, -2.5], 2, 4), [beam_start, beam_start + 1]
        batch = torch.stack(logits)
        mode.prepare(batch, beam_rows)
        out = sampler(batch, rows, generators, beam_rows)
        plain_owner = [o for o in owner if o != "beam"]
        tokens = torch.tensor(out.token_ids)
        for name in names:
            drawn[name].append(tokens[[i for i, o in enumerate(plain_owner) if o == name]])
        assert out.token_ids[-1] == int(greedy_logits.argmax())
        flat = (torch.log_softmax(beam_logits, -1) + torch.tensor([[-1.0], [-2.5]])).flatten()
        best = flat.topk(4)
        cand = mode.select(out.scores, beam_rows, params[beam_start], None)
        assert cand.token_ids == (best.indices % VOCAB).tolist()
        assert cand.parents == (best.indices // VOCAB).tolist()
    return {name: torch.cat(v) for name, v in drawn.items()}


@pytest.mark.parametrize("seeded", [False, True], ids=["engine-stream", "seeded-requests"])
def test_draws_follow_hf_distribution(cases, seeded):
    draws = _run(cases, steps=12, per_setting=2500, seeded=seeded)
    delta = FALSE_FAILURE / len(cases)
    for name, tokens in draws.items():
        assert_draws_follow(tokens, cases[name][2], delta, label=name)


def test_top_k_then_top_p_keeps_the_nucleus_of_top_k(cases):
    """The case that was wrong: top-p must cut inside what top-k kept."""
    _, raw, probs = cases["top_k+top_p"]
    alone_k = hf_probs(raw, temperature=0.7, top_k=12)
    assert int((alone_k > 0).sum()) == 12
    assert 0 < int((probs > 0).sum()) < 12  # the pair keeps fewer tokens than top-k alone


def test_warped_probs_equal_hf_per_row(cases):
    """``sampling_probs`` on the whole mixed batch against HF's warpers row by row
    (float32 softmax vs HF's scores softmaxed in float64: 1e-6 covers the rounding)."""
    names = list(cases)
    params = [cases[n][0] for n in names]
    processed = torch.stack([_hf_processed(cases[n][1], SETTINGS[n][0]) for n in names])
    got = sampling_probs(processed, params)
    for i, name in enumerate(names):
        expect = cases[name][2]
        assert torch.equal(got[i] > 0, expect > 0), name
        torch.testing.assert_close(got[i].double(), expect, atol=1e-6, rtol=1e-5, msg=name)


def test_ties_at_the_kth_score_are_kept_as_hf_keeps_them():
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.5]])
    got = sampling_probs(scores, [SamplingParams(top_k=2)])
    expect = hf_probs(scores[0], top_k=2)
    assert torch.equal(got[0] > 0, expect > 0)
    assert int((got > 0).sum()) == 4  # the three tied at the 2nd score all stay


def test_draw_never_picks_a_zero_probability_token_even_when_q_is_zero(monkeypatch):
    """An exponential of exactly 0 must not make 0 / 0 = NaN win the argmax."""
    from tandem.core.worker import warpers

    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0]])

    def zeros_exponential(self, *a, **k):
        return self.zero_()

    monkeypatch.setattr(torch.Tensor, "exponential_", zeros_exponential)
    tok = warpers.draw(probs, [None], torch.Generator())
    assert int(tok[0]) in (1, 2)


@pytest.mark.parametrize("candidates", [1, 16, 256, 4096])
def test_top_p_equals_hf_whether_the_nucleus_fits_the_candidates_or_not(monkeypatch, candidates):
    """Rows whose nucleus fits in ``TOP_P_CANDIDATES`` are decided from those, the rest
    by a whole sort; peaked and flat rows in one batch take both paths."""
    from tandem.core.worker import warpers

    monkeypatch.setattr(warpers, "TOP_P_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(3)
    vocab = 2000
    stds = [0.3, 1.0, 3.0, 8.0, 0.3, 8.0]
    fields = [dict(top_p=0.9), dict(top_p=0.5, temperature=0.8), dict(top_p=0.95), dict(top_p=0.7),
              dict(top_p=1.0), dict(top_p=0.3, top_k=40)]
    scores = torch.stack([torch.randn(vocab, generator=g) * s for s in stds])
    got = warpers.sampling_probs(scores.clone(), [SamplingParams(**f) for f in fields])
    for i, f in enumerate(fields):
        probs_fn = lambda s, f=f: hf_probs(s, **f)  # noqa: E731
        assert_support_stable(probs_fn, scores[i], eta=1e-4)
        expect = probs_fn(scores[i])
        assert torch.equal(got[i] > 0, expect > 0), (i, f)
        torch.testing.assert_close(got[i].double(), expect, atol=1e-6, rtol=1e-5)
