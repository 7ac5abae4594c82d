"""The LM-head screen (``lm_head_screen``): its bound against float64, its tokens
against the float64 argmax, and an engine with it against one without.

Oracle: float64 logits ``h . W + b`` of the same float32 inputs. The screen promises
the float32 argmax; float32 itself rounds each logit by up to ``d * 2^-24 *
sum|h_i W_ji|`` (~1e-5 here), so where float64's top two are closer than
:data:`TIE` either is accepted, and nowhere else.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import tandem
from tandem import LLM, SamplingParams
from tandem.core.layers.lm_head_screen import ScreenedHead, screen_unsupported
from tandem.core.worker.greedy_screen import MAX_CANDIDATES, StepScreen

pytestmark = pytest.mark.skipif(bool(screen_unsupported(torch.device("cpu"), torch.float32)),
                                reason="; ".join(screen_unsupported(torch.device("cpu"), torch.float32)))

TIE = 1e-4


class _Head(torch.nn.Module):
    """A stand-in LM head layer: what StepScreen reads of one (``weight``, ``head_logits``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def head_logits(self, h, bias):
        return torch.nn.functional.linear(h, self.weight, bias)


def _cases():
    g = torch.Generator().manual_seed(0)
    d, v = 96, 3000
    plain = torch.randn(v, d, generator=g) * 0.05
    # Rows of very different norms (trained vocabularies: frequent tokens' rows are larger).
    scaled = plain * torch.logspace(-2, 1, v)[torch.randperm(v, generator=g)][:, None]
    # Near-duplicate rows: their logits differ by far less than the int8 error, so only the
    # exact pass can order them (1e-3 apart: must be ordered right; 1e-9: a float32 tie).
    twins = plain.clone()
    twins[1::2] = twins[0::2] + 1e-3 * torch.randn(v // 2, d, generator=g) / d ** 0.5
    ties = plain.clone()
    ties[1::2] = ties[0::2] + 1e-9
    hidden = torch.randn(8, d, generator=g)
    outliers = hidden.clone()
    outliers[:, 5] *= 60.0  # one activation channel far larger than the rest (LayerNorm outputs have these)
    bias = torch.randn(v, generator=g)
    return [("plain", plain, hidden, None), ("scaled rows", scaled, hidden, None), ("twins", twins, hidden, None),
            ("ties", ties, hidden, None), ("outliers", plain, outliers, None), ("bias", plain, hidden, bias),
            ("zero row", plain, torch.cat([hidden[:3], torch.zeros(1, d)]), None)]


@pytest.mark.parametrize("name,weight,hidden,bias", _cases(), ids=[c[0] for c in _cases()])
def test_bound_holds_against_float64(name, weight, hidden, bias):
    head = ScreenedHead(weight)
    approx, pieces = head.approximate(hidden, bias)
    exact = hidden.double() @ weight.double().t() + (0 if bias is None else bias.double())
    cols = torch.arange(weight.shape[0]).expand(hidden.shape[0], -1)
    eps = head.bound(pieces, cols)
    err = (exact - approx.double()).abs()
    assert bool((err <= eps).all()), f"{name}: error {float((err - eps).max()):.3g} past the bound"
    # The row-wide bound covers every column's.
    assert bool((head.bound(pieces)[:, None] >= eps).all())
    # Not vacuous: the bound is far below the logits' spread, or screening would never pay.
    assert float(eps.median()) < 0.1 * float(exact.std())


def _oracle_ok(exact64: torch.Tensor, chosen: int) -> bool:
    top = float(exact64.max())
    return float(exact64[chosen]) >= top - TIE


def _screen(weight, hidden, bias, bans=None):
    head, layer = ScreenedHead(weight), _Head(weight)
    screen = StepScreen()
    logits = screen.offer(layer, head, hidden, bias)
    assert logits is not None
    if bans is not None:
        logits[bans] = float("-inf")
    return screen, screen.tokens(logits), logits


@pytest.mark.parametrize("name,weight,hidden,bias", _cases(), ids=[c[0] for c in _cases()])
def test_tokens_are_the_float64_argmax(name, weight, hidden, bias):
    g = torch.Generator().manual_seed(1)
    bans = torch.rand(hidden.shape[0], weight.shape[0], generator=g) < 0.3
    bans[0] = False
    screen, tokens, _ = _screen(weight, hidden, bias, bans)
    exact = hidden.double() @ weight.double().t() + (0 if bias is None else bias.double())
    exact[bans] = float("-inf")
    for r, t in enumerate(tokens.tolist()):
        assert not bool(bans[r, t]), f"{name}: row {r} chose a banned token"
        assert _oracle_ok(exact[r], t), f"{name}: row {r} chose {t}, float64 argmax {int(exact[r].argmax())}"
    assert screen.rows_screened + screen.rows_full == hidden.shape[0]


def test_twins_need_the_exact_pass():
    """Where two tokens' int8 logits cannot order them, both are candidates: the
    exact pass orders them (with the int8 argmax alone, about half the rows would be wrong)."""
    _, weight, hidden, _ = _cases()[2]
    exact = hidden.double() @ weight.double().t()
    screen, tokens, _ = _screen(weight, hidden, None)
    assert screen.rows_screened > 0 and min(screen.candidates) >= 2
    assert tokens.tolist() == exact.argmax(dim=1).tolist()


def test_flat_rows_fall_back_to_the_full_row():
    """More candidates than MAX_CANDIDATES (a near-flat distribution): the full float32 row."""
    g = torch.Generator().manual_seed(2)
    d, v = 64, 2000
    base = torch.randn(1, d, generator=g) * 0.05
    weight = base + 1e-6 * torch.randn(v, d, generator=g)  # every logit within the int8 error
    hidden = torch.randn(3, d, generator=g)
    screen, tokens, _ = _screen(weight, hidden, None)
    assert screen.rows_full == 3 and screen.rows_screened == 0
    exact = hidden.double() @ weight.double().t()
    for r, t in enumerate(tokens.tolist()):
        assert _oracle_ok(exact[r], t)
    assert v > MAX_CANDIDATES


def test_rows_without_a_finite_score():
    """Every token banned, or NaN activations: the same token as the plain argmax (which
    the sampler then reports as no token, or as non-finite logits)."""
    weight = torch.randn(500, 32) * 0.05
    hidden = torch.randn(2, 32)
    hidden[1, 3] = float("nan")
    bans = torch.zeros(2, 500, dtype=torch.bool)
    bans[0] = True
    screen, tokens, logits = _screen(weight, hidden, None, bans)
    assert tokens.tolist()[0] == 0  # argmax of all -inf
    assert bool(torch.isnan(logits[1]).all())
    assert tokens.tolist()[1] == 0  # the first NaN
    assert screen.rows_full == 2


def test_more_rows_than_allowed_are_not_screened():
    weight = torch.randn(100, 16)
    screen = StepScreen(max_rows=2)
    assert screen.offer(_Head(weight), ScreenedHead(weight), torch.randn(3, 16), None) is None
    assert screen.tokens(torch.zeros(3, 100)) is None


# -- the engine, with and without ------------------------------------------------------

def _prompts(n: int, seed: int, vocab: int, lo: int = 4):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [0] + [rng.randrange(lo, vocab) for _ in range(rng.randint(3, 12))] + [2]}
            for _ in range(n)]


@pytest.fixture(scope="module")
def demo_engines():
    demo = Path(tandem.__file__).parent / "demo_model"
    kw = dict(model=str(demo), dtype="float32", seed=0, max_num_seqs=4)
    return LLM(lm_head_screen="auto", **kw), LLM(lm_head_screen="off", **kw)


def test_engine_tokens_equal_without_the_screen(demo_engines):
    """A trained checkpoint (the demo's word reversal), greedy with processors that ban
    (min_tokens, no_repeat_ngram_size, bad_words): the same tokens with and without."""
    on, off = demo_engines
    prompts = [{"prompt": s} for s in ("the cat sat on the mat", "my dog ate the red apple",
                                      "we walked to the park today", "a b c d e f g")]
    prompts += _prompts(6, 0, 375)
    cases = [SamplingParams(temperature=0, max_tokens=12),
             SamplingParams(temperature=0, max_tokens=12, min_tokens=10, no_repeat_ngram_size=2),
             SamplingParams(temperature=0, max_tokens=12, bad_words_ids=[[7], [9, 10]])]
    before = on.llm_engine.worker.screen_stats.rows_screened
    for params in cases:
        a = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
        assert a == b
    stats = on.llm_engine.worker.screen_stats
    assert stats.rows_screened > before  # the screen really served these steps
    assert off.llm_engine.worker.screen_stats.steps == 0


def test_engine_steps_the_screen_cannot_serve(demo_engines):
    """Logprobs, sampling, beams and a logit bias read real logits: those steps are not
    screened, and give what the engine without the screen gives."""
    on, off = demo_engines
    prompts = [{"prompt": "the cat sat on the mat"}, {"prompt": "she read a very long book"}]
    stats = on.llm_engine.worker.screen_stats
    for params in (SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                   SamplingParams(temperature=0.8, max_tokens=6, seed=3),
                   SamplingParams(temperature=0, max_tokens=6, num_beams=2),
                   SamplingParams(temperature=0, max_tokens=6, logit_bias={5: 3.0})):
        steps = stats.steps
        a = on.generate(prompts, params, use_tqdm=False)
        b = off.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        if params.logprobs:
            assert [o.outputs[0].cumulative_logprob for o in a] == [o.outputs[0].cumulative_logprob for o in b]
        assert stats.steps == steps, params


def test_engine_start_line_and_choices(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", seed=0, lm_head_screen="auto")
    assert "lm_head_screen: " in llm.llm_engine.worker.linear_kernels
    int8 = LLM(model=str(bart_dir), dtype="float32", seed=0, quantization="int8")
    assert "lm_head_screen" not in int8.llm_engine.worker.linear_kernels  # its head is int8 already
    assert not any(getattr(m, "screen_head", None) for m in int8.llm_engine.worker.model.modules())
    with pytest.raises(ValueError, match="lm_head_screen"):
        LLM(model=str(bart_dir), lm_head_screen="fast")


def test_the_screen_steps_aside_where_it_does_not_pay():
    """Flat distributions (every row needs its full float32 row): after a few such steps
    only every PROBE_EVERY-th eligible step is screened; once rows resolve again, all are."""
    from tandem.core.worker.greedy_screen import PROBE_EVERY, ScreenStats

    g = torch.Generator().manual_seed(3)
    d, v = 32, 1000
    flat = torch.randn(1, d, generator=g) * 0.05 + 1e-6 * torch.randn(v, d, generator=g)
    sharp = torch.randn(v, d, generator=g) * 0.05
    stats = ScreenStats()

    def step(weight):
        if not stats.wanted():
            return False
        screen, _, _ = _screen(weight, torch.randn(2, d, generator=g), None)
        stats.add(screen)
        return True

    assert all(step(flat) for _ in range(4))  # 0.2, 0.36, 0.49, 0.59: above the limit after 4
    screened = sum(step(flat) for _ in range(4 * PROBE_EVERY))
    assert screened == 4  # the probes only
    while not step(sharp):  # the next probe finds rows that resolve
        pass
    for _ in range(8):
        step(sharp)
    assert stats.full_share < 0.5 and all(step(sharp) for _ in range(10))


@pytest.mark.parametrize("rows, cols, bad", [(3, slice(0, 16), float("nan")), (1, slice(None), float("nan")),
                                             (3, slice(None), float("inf"))])
def test_a_row_of_nan_or_inf_activations_fails_no_other_row(rows, cols, bad):
    """The int8 kernel quantizes every row at once (one range per tensor): a row partly NaN,
    or a step of one NaN row (an overflow upstream, e.g. a LoRA adapter's), made it raise,
    failing every row of the step. Now that row's logits are NaN; the others' tokens are exact."""
    torch.manual_seed(3)
    weight = torch.randn(500, 32) * 0.05
    hidden = torch.randn(rows, 32)
    hidden[0, cols] = bad
    screen, tokens, logits = _screen(weight, hidden, None, torch.zeros(rows, 500, dtype=torch.bool))
    assert bool(torch.isnan(logits[0]).all())
    exact = hidden @ weight.t()
    for r in range(rows):
        if r != 0:
            assert _oracle_ok(exact[r], tokens.tolist()[r])
