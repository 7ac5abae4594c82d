"""Unit tests of the sampling distribution (``tandem.core.worker.warpers``) and the
``Sampler``'s plain (non-beam) rows, against HF's warpers applied in HF's order
(``distribution.hf_probs``).

The support (which tokens can be drawn) must equal HF's exactly, on random rows and
on the rows where an implementation goes wrong: ties at a cut, ``-inf`` scores, a
single allowed token, ``top_p=1.0``, ``min_p=0``, a tiny ``top_p``, the cases where
the order of the stages decides the support. Draw frequencies are checked against
the exact probabilities with the bound derived in ``distribution.py``. Everything
here is decided by float32 values far from a cut (``assert_support_stable``) and by
seeded generators, so the thread count does not enter.
"""

from __future__ import annotations

import math

import pytest
import torch

from distribution import FALSE_FAILURE, assert_draws_follow, assert_support_stable, hf_probs
from tandem import SamplingParams
from tandem.core.worker.logits_processors import ProcessorRows
from tandem.core.worker.sampler import Sampler
from tandem.core.worker.warpers import draw, sampling_probs

NEG_INF = -math.inf


def _hf(scores: torch.Tensor, fields: dict) -> torch.Tensor:
    """HF's probabilities for ``SamplingParams(**fields)`` (top_k -1 is off, as HF's 0)."""
    f = {k: fields[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in fields}
    if f.get("top_k", 0) < 0:
        f["top_k"] = 0
    return hf_probs(scores, **f)


def _ours(scores: torch.Tensor, fields: dict) -> torch.Tensor:
    return sampling_probs(scores.float()[None].clone(), [SamplingParams(**fields)])[0]


def _support(p: torch.Tensor) -> set[int]:
    return set((p > 0).nonzero().flatten().tolist())


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# -- random rows, one batch, every combination of stages ---------------------------------------

# Each stage on and off, alone and together (one row each, its own logits).
RANDOM_SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.5),
    dict(top_k=1),
    dict(top_k=7),
    dict(top_k=5000),  # larger than the vocabulary: off
    dict(top_p=0.3),
    dict(top_p=0.9, temperature=0.7),
    dict(top_p=0.999),
    dict(min_p=0.05),
    dict(min_p=0.5, temperature=1.5),
    dict(top_k=50, top_p=0.6),
    dict(top_k=50, min_p=0.2),
    dict(top_p=0.8, min_p=0.1),
    dict(temperature=0.8, top_k=100, top_p=0.95, min_p=0.02),
    dict(temperature=1.7, top_k=20, top_p=0.5, min_p=0.3),
]
VOCAB = 1000


@pytest.fixture(scope="module")
def random_rows():
    g = torch.Generator().manual_seed(11)
    stds = [0.5, 1.0, 2.0, 4.0]
    rows = torch.stack([torch.randn(VOCAB, generator=g) * stds[i % len(stds)] for i in range(len(RANDOM_SETTINGS))])
    expect = []
    for row, fields in zip(rows, RANDOM_SETTINGS):
        # float32 reductions split by thread count move probabilities by ~1e-7: far below this.
        assert_support_stable(lambda s, f=fields: _hf(s, f), row, eta=1e-4)
        expect.append(_hf(row, fields))
    return rows, expect


def test_random_rows_in_one_batch_have_hf_s_support_and_probabilities(random_rows):
    rows, expect = random_rows
    got = sampling_probs(rows.clone(), [SamplingParams(**f) for f in RANDOM_SETTINGS])
    for i, fields in enumerate(RANDOM_SETTINGS):
        assert _support(got[i]) == _support(expect[i]), (fields, len(_support(got[i])), len(_support(expect[i])))
        torch.testing.assert_close(got[i].double(), expect[i], atol=1e-6, rtol=1e-5, msg=str(fields))
    # The fixture exercises every stage: each truncating setting cuts something.
    sizes = {str(f): len(_support(e)) for f, e in zip(RANDOM_SETTINGS, expect)}
    assert sizes[str(dict(top_k=7))] == 7 and sizes[str(dict(top_k=1))] == 1
    for f in (dict(top_p=0.3), dict(min_p=0.05), dict(top_k=50, top_p=0.6), dict(top_p=0.8, min_p=0.1)):
        assert 1 < sizes[str(f)] < VOCAB, f


# -- adversarial rows ------------------------------------------------------------------------

P4 = [0.4, 0.3, 0.2, 0.1]
# (id, scores, fields, the support derived by hand)
ADVERSARIAL = [
    # top-p keeps a token while the mass before it is below top_p: 0, .4, .7 < .75; .9 is not.
    ("top_p cut", _log(P4), dict(top_p=0.75), {0, 1, 2}),
    # min-p is relative to the max: .1 / .4 < .3.
    ("min_p cut", _log(P4), dict(min_p=0.3), {0, 1, 2}),
    # HF's order: top-p on the whole row keeps {0, 1, 2}, min-p then keeps them (.2/.4 >= .3).
    # min-p first would renormalise to [.44, .33, .22] and top-p would then drop token 2.
    ("top_p before min_p", _log(P4), dict(top_p=0.75, min_p=0.3), {0, 1, 2}),
    # top-p inside what top-k kept: top-k 2 renormalises to [.57, .43]; top-p .5 keeps one.
    ("top_k before top_p", _log(P4), dict(top_k=2, top_p=0.5), {0}),
    # Temperature first: at T=0.25 the row becomes [.70, .22, .04, .004]; top-p .8 keeps two.
    ("temperature before top_p", _log(P4), dict(temperature=0.25, top_p=0.8), {0, 1}),
    # top_p = 1.0 and min_p = 0 cut nothing, however small a probability.
    ("top_p 1.0", _log([0.9, 0.0999, 1e-4, 1e-30]), dict(top_p=1.0), {0, 1, 2, 3}),
    ("min_p 0", _log([0.9, 0.0999, 1e-4, 1e-30]), dict(min_p=0.0), {0, 1, 2, 3}),
    # A tiny top_p keeps the most probable token only (HF's min_tokens_to_keep = 1).
    ("tiny top_p", _log([0.2, 0.5, 0.3]), dict(top_p=1e-6), {1}),
    ("smallest top_p", _log([0.2, 0.5, 0.3]), dict(top_p=1.2e-38), {1}),
    # min_p = 1 keeps the tokens tied at the max, and only those.
    ("min_p 1 with a tie at the max", _log([0.3, 0.1, 0.3, 0.3]), dict(min_p=1.0), {0, 2, 3}),
    # Ties at the k-th score all stay (HF compares with the k-th value).
    ("top_k tie", torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.5]), dict(top_k=2), {0, 2, 3, 4}),
    # -inf scores (banned tokens) are never drawn, and top-k larger than what is left is off.
    ("-inf with top_k", torch.tensor([NEG_INF, 1.0, NEG_INF, 0.5, NEG_INF]), dict(top_k=4), {1, 3}),
    ("-inf with top_p", torch.tensor([NEG_INF, 1.0, NEG_INF, 0.9, 0.0]), dict(top_p=0.99), {1, 3, 4}),
    ("-inf with min_p", torch.tensor([NEG_INF, 1.0, NEG_INF, 0.9, -5.0]), dict(min_p=0.01, temperature=0.5), {1, 3}),
    # One allowed token: every stage keeps it, whatever the values.
    *[
        (f"single token, {name}", torch.tensor([NEG_INF] * 7 + [-3.0] + [NEG_INF] * 4), fields, {7})
        for name, fields in [
            ("plain", dict()),
            ("all stages", dict(temperature=0.3, top_k=5, top_p=0.1, min_p=0.9)),
            ("top_k 1", dict(top_k=1)),
            ("high temperature", dict(temperature=50.0)),
        ]
    ],
]


@pytest.mark.parametrize("scores, fields, support", [c[1:] for c in ADVERSARIAL], ids=[c[0] for c in ADVERSARIAL])
def test_adversarial_rows_have_hf_s_support(scores, fields, support):
    expect = _hf(scores, fields)
    assert _support(expect) == support  # the hand derivation agrees with HF
    got = _ours(scores, fields)
    assert _support(got) == support
    torch.testing.assert_close(got.double(), expect, atol=1e-6, rtol=1e-5)


def test_all_adversarial_rows_in_one_batch_keep_their_own_values():
    """Rows of different lengths cannot share a batch; pad them with -inf (never drawn)."""
    width = max(c[1].numel() for c in ADVERSARIAL)
    rows = torch.full((len(ADVERSARIAL), width), NEG_INF)
    for i, c in enumerate(ADVERSARIAL):
        rows[i, : c[1].numel()] = c[1]
    got = sampling_probs(rows.clone(), [SamplingParams(**c[2]) for c in ADVERSARIAL])
    for i, (name, _, _, support) in enumerate(ADVERSARIAL):
        assert _support(got[i]) == support, name


@pytest.mark.parametrize("scores, top_p, tied, kept", [
    # Four tokens tied at .2 and the cut inside them: the mass before each is 0, .2, .4 < .5, then .6.
    (_log([0.2, 0.1, 0.2, 0.2, 0.1, 0.2]), 0.5, {0, 2, 3, 5}, 3),
    # The mass before a token equal to top_p, exactly (quarters add up exactly in float32):
    # HF drops it (its ascending cumsum .25, .5 is <= 1 - top_p), so 2 stay, not 3.
    (torch.zeros(4), 0.5, {0, 1, 2, 3}, 2),
    (torch.zeros(4), 0.75, {0, 1, 2, 3}, 3),
], ids=["cut inside a tie", "top_p equal to a mass, 1/2", "top_p equal to a mass, 3/4"])
def test_ties_at_the_top_p_cut_keep_as_many_as_hf(scores, top_p, tied, kept):
    """Which of the tied tokens stay is the sort's choice (HF's too); how many is not."""
    expect, got = _hf(scores, dict(top_p=top_p)), _ours(scores, dict(top_p=top_p))
    assert len(_support(expect)) == len(_support(got)) == kept
    assert _support(got) <= tied and _support(expect) <= tied
    torch.testing.assert_close(got[got > 0].double(), torch.full((kept,), 1 / kept, dtype=torch.float64))


def test_a_flat_row_whose_nucleus_is_wider_than_the_candidates():
    """A flat row over 4096 tokens: the nucleus holds thousands, past TOP_P_CANDIDATES.
    Its scores are spread evenly (5e-4 apart, shuffled), so no two sit closer to a cut
    than float32's differences across thread counts (~1e-7)."""
    from tandem.core.worker.warpers import TOP_P_CANDIDATES

    scores = torch.linspace(0.0, -2.0, 4096)[torch.randperm(4096, generator=torch.Generator().manual_seed(5))]
    for fields in (dict(top_p=0.9), dict(top_p=0.9, min_p=0.8)):
        assert_support_stable(lambda s, f=fields: _hf(s, f), scores, eta=1e-5)
        expect = _hf(scores, fields)
        assert _support(_ours(scores, fields)) == _support(expect), fields
    assert TOP_P_CANDIDATES < len(_support(_hf(scores, dict(top_p=0.9)))) < 4096


# -- draws -------------------------------------------------------------------------------------

# Rows whose exact distribution the draws must follow: (scores, fields).
DRAW_CASES = {
    "top_p": (_log([0.35, 0.25, 0.2, 0.1, 0.06, 0.04]), dict(top_p=0.75)),
    "min_p": (_log([0.35, 0.25, 0.2, 0.1, 0.06, 0.04]), dict(min_p=0.25)),
    "top_p then min_p": (_log([0.4, 0.3, 0.2, 0.1]), dict(top_p=0.75, min_p=0.3)),
    "temperature, top_k, -inf": (torch.tensor([1.0, NEG_INF, 0.2, -0.4, 0.9, NEG_INF, -1.0]),
                                 dict(temperature=0.6, top_k=4)),
    "single token": (torch.tensor([NEG_INF, NEG_INF, 2.0, NEG_INF]), dict(top_p=0.5, min_p=0.5)),
}
DRAWS = 20_000
DRAW_WIDTH = max(scores.numel() for scores, _ in DRAW_CASES.values())


def _exact(name: str, width: int = DRAW_WIDTH) -> torch.Tensor:
    """HF's probabilities for a draw case, padded with the zeros of the -inf padding."""
    scores, fields = DRAW_CASES[name]
    return torch.nn.functional.pad(_hf(scores, fields), (0, width - scores.numel()))


def _draw_rows(seeded: bool, num_draws: int) -> dict[str, torch.Tensor]:
    """``num_draws`` tokens per case, all cases interleaved in the batches."""
    names = list(DRAW_CASES)
    one = torch.full((len(names), DRAW_WIDTH), NEG_INF)
    for i, name in enumerate(names):
        one[i, : DRAW_CASES[name][0].numel()] = DRAW_CASES[name][0]
    per_batch = 2000
    reps = one.repeat(per_batch, 1)  # [per_batch * cases, width], cases interleaved
    params = [SamplingParams(**DRAW_CASES[n][1]) for n in names] * per_batch
    probs = sampling_probs(reps.clone(), params)
    default = torch.Generator().manual_seed(99)
    out = {n: [] for n in names}
    for b in range(num_draws // per_batch):
        gens = [torch.Generator().manual_seed(1000 * b + i) if seeded else None for i in range(len(params))]
        tokens = draw(probs, gens, default).view(per_batch, len(names))
        for i, n in enumerate(names):
            out[n].append(tokens[:, i])
    return {n: torch.cat(v) for n, v in out.items()}


# A seeded row draws from its own generator, one call per row: fewer draws keep it fast.
@pytest.mark.parametrize("seeded, num_draws", [(False, DRAWS), (True, DRAWS // 4)],
                         ids=["engine-stream", "seeded-rows"])
def test_draws_follow_the_exact_probabilities(seeded, num_draws):
    draws = _draw_rows(seeded, num_draws)
    delta = FALSE_FAILURE / len(DRAW_CASES)
    for name in DRAW_CASES:
        stats = assert_draws_follow(draws[name], _exact(name), delta, label=name)
        assert stats["drawn"] == stats["support"], name  # 5,000 draws reach every token of mass >= .04


def test_a_seeded_row_draws_the_same_whatever_its_neighbours():
    probs = sampling_probs(_log([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])[None].repeat(3, 1), [SamplingParams()] * 3)
    alone = [int(draw(probs[:1], [torch.Generator().manual_seed(7)], torch.Generator())[0]) for _ in range(20)]
    mixed = [int(draw(probs, [None, torch.Generator().manual_seed(7), None],
                      torch.Generator().manual_seed(i))[1]) for i in range(20)]
    assert alone == mixed


# -- the Sampler's plain rows ------------------------------------------------------------------


def test_sampler_plain_rows_greedy_and_sampled():
    """A batch of greedy rows and sampled rows (no beams) through ``Sampler``: greedy
    rows take the argmax, sampled rows follow their own exact distribution."""
    names = ["top_p", "min_p", "single token"]
    width = 6
    sampled = torch.full((len(names), width), NEG_INF)
    for i, n in enumerate(names):
        sampled[i, : DRAW_CASES[n][0].numel()] = DRAW_CASES[n][0]
    greedy = torch.tensor([0.1, 0.5, 2.0, -1.0, 1.9, 0.0])
    rows_logits = torch.cat([greedy[None], sampled, greedy.flip(0)[None]])
    params = [SamplingParams(temperature=0.0)] + [SamplingParams(**DRAW_CASES[n][1]) for n in names] + [
        SamplingParams(temperature=0.0)]
    per_step = 1000
    logits = rows_logits.repeat(per_step, 1)
    all_params = params * per_step
    s = len(all_params)
    rows = ProcessorRows(all_params, [0] * s, [1] * s)
    sampler = Sampler(eos_token_ids=[width + 10], seed=3)
    tokens = []
    for _ in range(10):
        out = sampler(logits.clone(), rows, [None] * s)
        assert not out.failed_rows and not out.no_token_rows
        tokens.append(torch.tensor(out.token_ids).view(per_step, len(params)))
    tokens = torch.cat(tokens)
    assert (tokens[:, 0] == 2).all() and (tokens[:, -1] == 3).all()  # the argmax of each greedy row
    delta = FALSE_FAILURE / len(names)
    for i, n in enumerate(names):
        assert_draws_follow(tokens[:, 1 + i], _exact(n, width), delta, label=n)
