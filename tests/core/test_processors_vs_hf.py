"""tandem's batched logits processors against HF transformers' own processors, row by row.

Each test builds one decode step: random float32 scores ``[S, VOCAB]`` and random
decoder histories (decoder prompt + output so far), rows with *different* settings
(different values, the processor off in some rows, rows sharing one
``SamplingParams`` object and rows with their own), runs tandem's
``LogitsProcessors`` once on the whole batch, and compares every row with HF's
processor applied to that row alone (``input_ids [1, L]``, ``scores [1, VOCAB]``).
Most tests run twice: on raw logits (greedy / sampled rows) and on log-probabilities
of beam rows (``num_beams > 1``), which is what both libraries process there.

Lengths as HF counts them for an encoder-decoder model: ``input_ids`` is the whole
decoder sequence, decoder prompt included, so ``cur_len`` is tandem's
``seq_lens[i]``; ``input_ids_seq_length`` (HF's prompt length, from which
``max_length``, ``min_new_tokens`` and ``begin_index`` count) is tandem's
``prompt_len(i) = seq_lens[i] - num_output_tokens[i]``.

Comparisons are exact (``torch.equal``, and the ``-inf`` positions compared on
their own) wherever both sides do the same float32 operations; presence and
frequency penalties, which HF lacks, are compared with an independent float64
formula under a bound derived in ``_penalty_bound``.

The whole chain is compared with the list HF's own ``_get_logits_processor``
builds for the row's settings (after HF's ``_prepare_generated_length``, which
resolves ``max_new_tokens`` / ``min_new_tokens`` into lengths), so the reference
order is HF's, not a transcription of it. tandem's deliberate differences (vLLM's
``ignore_eos`` / ``stop_token_ids`` in min_tokens, presence / frequency placement,
``allowed_token_ids`` beam rows) are the ones its module docstring lists.

The histories returned to tandem are padded with random valid token ids (as the
worker's history store may hold stale tokens past a row's length), and asking for
the history of a row that does not need it fails the test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from tandem import SamplingParams
from tandem.core.worker.logits_processors import LogitsProcessors, ProcessorRows, needs_history

VOCAB = 300
EOS = [2, 7]  # two EOS ids, as some checkpoints have
COMMON = [11, 12, 13, 14, 15]  # most history tokens come from these, so n-grams and bad-word prefixes recur
NEG_INF = float("-inf")
EPS32 = torch.finfo(torch.float32).eps

KINDS = ["logits", "beam-logprobs"]


@dataclass
class Row:
    params: SamplingParams
    prompt_len: int
    tokens: list[int]  # the decoder sequence so far: decoder prompt, then output

    @property
    def num_out(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.tensor([self.tokens])


def _tokens(rng: random.Random, prompt_len: int, num_out: int, repeat: bool = True) -> list[int]:
    """A decoder start token, then prompt and output tokens mostly from ``COMMON``;
    with ``repeat``, often ending in a copy of an earlier stretch (so an n-gram's
    first n - 1 tokens recur at the end)."""
    n = prompt_len + num_out
    toks = [0] + [rng.choice(COMMON) if rng.random() < 0.7 else rng.randrange(VOCAB) for _ in range(n - 1)]
    if repeat and n >= 4 and rng.random() < 0.6:
        k = rng.randint(1, min(3, n // 2))
        start = rng.randrange(0, n - k)
        toks[n - k:] = toks[start:start + k]
    return toks


def _beam(p: SamplingParams) -> SamplingParams:
    return p.replace(num_beams=2, temperature=0.0)


def _step(rows: list[Row], kind: str, seed: int, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """tandem's processors on the whole batch: (input scores, processed scores).
    Beam rows get log-probabilities (the sampler's log_softmax of the logits)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(rows), VOCAB, generator=g) * scale
    if kind == "beam-logprobs":
        beam: dict[int, SamplingParams] = {}  # rows that shared a params object share its beam version
        rows[:] = [Row(beam.setdefault(id(r.params), _beam(r.params)), r.prompt_len, r.tokens) for r in rows]
        scores = torch.log_softmax(scores, dim=-1)
    lengths = torch.tensor([len(r.tokens) for r in rows])
    # Past each row's length: stale but valid token ids, as a reused history store holds.
    history = torch.randint(0, VOCAB, (len(rows), int(lengths.max())), generator=g)
    for i, r in enumerate(rows):
        history[i, : len(r.tokens)] = torch.tensor(r.tokens)

    def get_history(idx: list[int]):
        bad = [i for i in idx if not needs_history(rows[i].params)]
        assert not bad, f"history asked for rows {bad}, whose params do not need it"
        sub = lengths[idx]
        return history[idx, : int(sub.max())].clone(), sub.clone()

    batch = ProcessorRows(
        [r.params for r in rows], [r.num_out for r in rows], [len(r.tokens) for r in rows], get_history,
        [r.params.num_beams > 1 for r in rows],  # the worker marks beam rows joint (BeamStep.joint_rows)
    )
    out = LogitsProcessors(list(EOS))(scores.clone(), batch)
    return scores, out


def _apply(procs: list[LogitsProcessor], row: Row, scores: torch.Tensor) -> torch.Tensor:
    x = scores[None].clone()
    for proc in procs:
        x = proc(row.input_ids, x)
    return x[0]


def _assert_row_equal(got: torch.Tensor, want: torch.Tensor, i: int, row: Row) -> None:
    where = f"row {i} (prompt {row.prompt_len}, output {row.num_out}, {row.params})"
    assert torch.equal(got.isneginf(), want.isneginf()), f"-inf positions differ in {where}"
    diff = (got != want).nonzero().flatten().tolist()
    assert not diff, f"{where}: tokens {diff[:10]}: tandem {got[diff[:10]].tolist()} vs HF {want[diff[:10]].tolist()}"


def _check(rows: list[Row], kind: str, seed: int, hf_procs) -> tuple[torch.Tensor, torch.Tensor]:
    scores, out = _step(rows, kind, seed)
    for i, r in enumerate(rows):
        _assert_row_equal(out[i], _apply(hf_procs(r), r, scores[i]), i, r)
    return scores, out


def _changed_rows(scores: torch.Tensor, out: torch.Tensor) -> set[int]:
    return {i for i in range(len(scores)) if not torch.equal(scores[i], out[i])}


# -- one processor at a time --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_repetition_penalty(kind):
    rng = random.Random(1)
    shared = SamplingParams(repetition_penalty=1.3)
    settings = [shared, shared, SamplingParams(repetition_penalty=0.7), SamplingParams(),
                SamplingParams(repetition_penalty=2.0), shared, SamplingParams(repetition_penalty=1.05),
                SamplingParams(repetition_penalty=0.31), SamplingParams(), shared,
                SamplingParams(repetition_penalty=1.7)]
    rows = [Row(p, pl := rng.randint(1, 4), _tokens(rng, pl, rng.randint(0, 14))) for p in settings]
    rows.append(Row(SamplingParams(repetition_penalty=1.9), 1, [0]))  # decoder start only

    def hf(r):  # HF compares penalty with 1.0 too; its penalty is a Python float, as ours is
        penalty = r.params.repetition_penalty
        return [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []

    scores, out = _check(rows, kind, 10, hf)
    assert _changed_rows(scores, out) == {i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0}


@pytest.mark.parametrize("kind", KINDS)
def test_no_repeat_ngram(kind):
    rng = random.Random(2)
    shared2 = SamplingParams(no_repeat_ngram_size=2)
    sizes = [shared2, SamplingParams(no_repeat_ngram_size=1), SamplingParams(no_repeat_ngram_size=3), shared2,
             SamplingParams(), SamplingParams(no_repeat_ngram_size=4), SamplingParams(no_repeat_ngram_size=3),
             shared2, SamplingParams(no_repeat_ngram_size=5), SamplingParams(no_repeat_ngram_size=1), shared2,
             SamplingParams(no_repeat_ngram_size=2)]
    rows = [Row(p, pl := rng.randint(1, 3), _tokens(rng, pl, rng.randint(0, 16))) for p in sizes]
    # Rows exactly at, and one short of, the first complete n-gram.
    rows += [Row(SamplingParams(no_repeat_ngram_size=3), 1, [0, 12, 12]),
             Row(SamplingParams(no_repeat_ngram_size=3), 1, [0, 12]),
             Row(SamplingParams(no_repeat_ngram_size=2), 2, [0, 12, 13, 12])]

    def hf(r):
        n = r.params.no_repeat_ngram_size
        return [NoRepeatNGramLogitsProcessor(n)] if n else []

    scores, out = _check(rows, kind, 20, hf)
    banned = {i for i in range(len(rows)) if int(out[i].isneginf().sum()) > 0}
    assert len(banned) >= 6 and 13 not in banned  # most rows ban something; the short row bans nothing


@pytest.mark.parametrize("kind", KINDS)
def test_bad_words(kind):
    rng = random.Random(3)
    words_a = [[40], [12, 13], [13, 12, 14], [2], [7, 50]]  # [2] is an EOS id: HF drops it
    words_b = [[12], [14, 15], [99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87, 86, 85, 84, 83, 82, 81, 80]]
    shared = SamplingParams(bad_words_ids=words_a)
    settings = [shared, SamplingParams(bad_words_ids=words_b), shared, SamplingParams(),
                SamplingParams(bad_words_ids=[[7]]), SamplingParams(bad_words_ids=[[15, 15], [11, 12, 13]]), shared,
                SamplingParams(bad_words_ids=words_b), shared]
    rows = []
    for p in settings:
        pl = rng.randint(1, 3)
        toks = _tokens(rng, pl, rng.randint(0, 10), repeat=False)
        multi = [w for w in p.bad_words_ids if len(w) > 1]
        if multi and rng.random() < 0.7:  # end on a bad word's prefix, so its last token is banned
            w = rng.choice(multi)
            if len(w) - 1 < len(toks):
                toks[len(toks) - (len(w) - 1):] = w[:-1]
        rows.append(Row(p, pl, toks))
    rows.append(Row(SamplingParams(bad_words_ids=[[0, 12, 13]]), 1, [0, 12]))  # prefix = the whole sequence
    rows.append(Row(SamplingParams(bad_words_ids=[[0, 12, 13], [44, 0, 12]]), 1, [0]))  # prefix longer than it

    def hf(r):
        words = [list(w) for w in r.params.bad_words_ids]
        return [NoBadWordsLogitsProcessor(words, EOS)] if words else []

    scores, out = _check(rows, kind, 30, hf)
    ends_on_prefix = sum(1 for r in rows for w in r.params.bad_words_ids
                         if 1 < len(w) <= len(r.tokens) + 1 and r.tokens[len(r.tokens) - len(w) + 1:] == list(w[:-1]))
    assert ends_on_prefix >= 4
    assert not out[:, 2].isneginf()[[0, 2, 6, 8]].any()  # the EOS single-token bad word was dropped



@pytest.mark.parametrize("seed", [0, 1])
def test_many_bad_words_of_every_width_match_hf(seed):
    """Hundreds of words per request, prefixes 1 to 40 long (every width bucket,
    shared words across buckets' edges), several requests with several rows each
    (n > 1 shares one params object), rows ending on a word's prefix or on part of
    one, histories shorter than some prefixes: every row equals HF's processor."""
    rng = random.Random(seed)
    settings = []
    for _ in range(5):
        words = []
        for _ in range(rng.randint(50, 300)):
            k = rng.choice([2, 2, 3, 5, 9, 16, 17, 33, 41])  # prefix lengths 1..40: widths 1, 2, 4, 8, 16, 32, 64
            words.append([rng.choice(COMMON) if rng.random() < 0.8 else rng.randrange(VOCAB) for _ in range(k)])
        words.append([rng.randrange(VOCAB)])
        settings.append(SamplingParams(bad_words_ids=words))
    settings.append(SamplingParams())  # a row with no bad words in between
    rows = []
    for p in settings:
        multi = [w for w in p.bad_words_ids if len(w) > 1]
        for _ in range(rng.randint(1, 4)):  # rows of one request share its params object
            toks = _tokens(rng, rng.randint(1, 3), rng.randint(0, 45), repeat=False)
            if multi and rng.random() < 0.8:
                w = rng.choice(multi)
                cut = rng.randint(1, len(w) - 1) if rng.random() < 0.3 else len(w) - 1  # all or part of a prefix
                toks = toks + list(w[len(w) - 1 - cut:len(w) - 1])
            rows.append(Row(p, min(3, len(toks)), toks))

    def hf(r):
        words = [list(w) for w in r.params.bad_words_ids]
        return [NoBadWordsLogitsProcessor(words, EOS)] if words else []

    scores, out = _check(rows, "logits", 40 + seed, hf)
    hits = sum(int(out[i].isneginf().sum()) - sum(1 for w in r.params.bad_words_ids if len(w) == 1)
               for i, r in enumerate(rows))
    assert hits >= 5  # multi-token bans happened, not only the one-token ones

def _hf_min_length(r: Row) -> list[LogitsProcessor]:
    """What HF ``generate`` builds for min_length / min_new_tokens: when
    ``min_new_tokens`` is set it *replaces* ``min_length`` by ``min_new_tokens +
    prompt length`` (``_prepare_generated_length``), then both processors run.
    tandem's two documented vLLM extensions: ``ignore_eos`` leaves EOS alone, and
    ``min_tokens`` bans ``stop_token_ids`` too (as an extra EOS list here)."""
    p, procs = r.params, []
    eos = [] if p.ignore_eos else EOS
    min_length = p.min_tokens + r.prompt_len if p.min_tokens else p.min_length
    if eos and min_length:
        procs.append(MinLengthLogitsProcessor(min_length, eos))
    if eos and p.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(r.prompt_len, p.min_tokens, eos))
    if p.min_tokens and p.stop_token_ids:
        procs.append(MinNewTokensLengthLogitsProcessor(r.prompt_len, p.min_tokens, list(p.stop_token_ids)))
    return procs


@pytest.mark.parametrize("kind", KINDS)
def test_min_length_and_min_new_tokens(kind):
    rng = random.Random(4)
    shared = SamplingParams(min_tokens=5)
    settings = [
        (shared, 2, 3), (shared, 2, 5), (shared, 1, 4), (SamplingParams(min_length=6), 2, 3),
        (SamplingParams(min_length=6), 3, 3), (SamplingParams(min_length=6), 4, 1),
        # Both set: min_new_tokens wins, in both directions.
        (SamplingParams(min_length=20, min_tokens=3), 2, 4), (SamplingParams(min_length=3, min_tokens=8), 2, 4),
        (SamplingParams(min_length=20, min_tokens=3), 2, 2),
        (SamplingParams(), 1, 0), (SamplingParams(min_tokens=4, stop_token_ids=[33, 34]), 1, 2),
        (SamplingParams(min_tokens=4, stop_token_ids=[33, 2]), 1, 5),
        (SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=[33]), 1, 1),
        (SamplingParams(min_length=9, ignore_eos=True), 2, 1),
    ]
    rows = [Row(p, pl, _tokens(rng, pl, n)) for p, pl, n in settings]
    scores, out = _check(rows, kind, 40, _hf_min_length)
    assert _changed_rows(scores, out) == {0, 2, 3, 5, 7, 8, 10, 12}


@pytest.mark.parametrize("kind", KINDS)
def test_forced_bos_and_forced_eos(kind):
    rng = random.Random(5)
    bos = SamplingParams(forced_bos_token_id=17, max_tokens=6)
    eos_many = SamplingParams(forced_eos_token_id=[2, 7, 40], max_tokens=4)
    settings = [
        (bos, 1, 0), (bos, 1, 1), (bos, 2, 0), (SamplingParams(forced_bos_token_id=18), 1, 0),
        (SamplingParams(forced_eos_token_id=2, max_tokens=5), 2, 4),
        (SamplingParams(forced_eos_token_id=2, max_tokens=5), 2, 3),
        (eos_many, 1, 3), (eos_many, 3, 3), (eos_many, 1, 2), (SamplingParams(max_tokens=5), 1, 4),
        # Both at the first step (one token allowed): HF's forced EOS comes second and wins.
        (SamplingParams(forced_bos_token_id=17, forced_eos_token_id=7, max_tokens=1), 1, 0),
        (SamplingParams(forced_bos_token_id=17, forced_eos_token_id=7, max_tokens=2), 1, 0),
    ]
    rows = [Row(p, pl, _tokens(rng, pl, n)) for p, pl, n in settings]

    def hf(r):
        p, procs = r.params, []
        if p.forced_bos_token_id is not None:
            procs.append(ForcedBOSTokenLogitsProcessor(p.forced_bos_token_id))
        if p.forced_eos_token_id:  # HF's max_length = max_new_tokens + decoder prompt length
            procs.append(ForcedEOSTokenLogitsProcessor(p.max_tokens + r.prompt_len, list(p.forced_eos_token_id)))
        return procs

    scores, out = _check(rows, kind, 50, hf)
    assert _changed_rows(scores, out) == {0, 3, 4, 6, 7, 10, 11}
    assert out[10].argmax() == 7 and out[11].argmax() == 17


@pytest.mark.parametrize("kind", KINDS)
def test_suppress_and_begin_suppress(kind):
    rng = random.Random(6)
    sup = SamplingParams(suppress_tokens=[3, 40, 41, 299])
    begin = SamplingParams(begin_suppress_tokens=[2, 12, 50])
    begin_bos = SamplingParams(begin_suppress_tokens=[2, 12, 50], forced_bos_token_id=12)
    settings = [
        (sup, 1, 0), (sup, 2, 5), (SamplingParams(suppress_tokens=[0]), 1, 3), (SamplingParams(), 2, 2),
        (begin, 1, 0), (begin, 1, 1), (begin, 3, 0), (begin, 3, 2),
        # A forced BOS after a one-token decoder prompt moves HF's begin index one later.
        (begin_bos, 1, 0), (begin_bos, 1, 1), (begin_bos, 1, 2), (begin_bos, 2, 0), (begin_bos, 2, 1),
        (SamplingParams(suppress_tokens=[12, 13], forced_bos_token_id=12, begin_suppress_tokens=[5]), 1, 0),
    ]
    rows = [Row(p, pl, _tokens(rng, pl, n)) for p, pl, n in settings]

    def hf(r):  # HF's order: forced BOS, suppress, begin-suppress (begin index as _get_logits_processor sets it)
        p, procs = r.params, []
        if p.forced_bos_token_id is not None:
            procs.append(ForcedBOSTokenLogitsProcessor(p.forced_bos_token_id))
        if p.suppress_tokens:
            procs.append(SuppressTokensLogitsProcessor(list(p.suppress_tokens)))
        if p.begin_suppress_tokens:
            begin = r.prompt_len if (r.prompt_len > 1 or p.forced_bos_token_id is None) else r.prompt_len + 1
            procs.append(SuppressTokensAtBeginLogitsProcessor(list(p.begin_suppress_tokens), begin))
        return procs

    scores, out = _check(rows, kind, 60, hf)
    assert _changed_rows(scores, out) == {0, 1, 2, 4, 6, 8, 9, 11, 13}
    assert out[13].isneginf().all()  # the forced token suppressed after forcing, in both


@pytest.mark.parametrize("kind", KINDS)
def test_logit_bias_is_hf_sequence_bias_of_single_tokens(kind):
    rng = random.Random(7)
    shared = SamplingParams(logit_bias={5: 3.0, 12: -4.25, 299: 0.1})
    settings = [shared, SamplingParams(logit_bias={0: -100.0, 1: 7.3}), shared, SamplingParams(),
                SamplingParams(logit_bias={12: 1e-3, 13: -2.2, 14: 2.2}), shared]
    rows = [Row(p, pl := rng.randint(1, 3), _tokens(rng, pl, rng.randint(0, 6))) for p in settings]

    def hf(r):
        return [SequenceBiasLogitsProcessor([[[t], b] for t, b in r.params.logit_bias])] if r.params.logit_bias else []

    scores, out = _check(rows, kind, 70, hf)
    assert _changed_rows(scores, out) == {0, 1, 2, 4, 5}


def _hf_allowed(r: Row, num_beams: int = 1) -> PrefixConstrainedLogitsProcessor:
    allowed = list(r.params.allowed_token_ids)
    return PrefixConstrainedLogitsProcessor(lambda batch_id, ids: allowed, num_beams)


@pytest.mark.parametrize("kind", KINDS)
def test_allowed_token_ids_is_hf_prefix_constrained(kind):
    """HF's PrefixConstrainedLogitsProcessor runs after min_length; tandem masks first.
    Banning commutes with the mask, except where the processors between ban every
    allowed token: HF then gives the allowed tokens a score of 0 so the constraint
    holds (for a beam request, when that happens to all its beams)."""
    rng = random.Random(8)
    shared = SamplingParams(allowed_token_ids=[2, 5, 12, 13, 77])
    settings = [
        (shared, 1, 3), (shared, 2, 0), (SamplingParams(allowed_token_ids=[0]), 1, 2), (SamplingParams(), 1, 1),
        (SamplingParams(allowed_token_ids=list(range(0, VOCAB, 3)), repetition_penalty=1.4), 2, 6),
        # Every allowed token banned before HF's constraint runs (EOS ids by min_tokens, 50 as a bad word).
        (SamplingParams(allowed_token_ids=[2, 7, 50], min_tokens=3, bad_words_ids=[[50]]), 1, 0),
        (SamplingParams(allowed_token_ids=[2, 7, 50], min_tokens=3, bad_words_ids=[[50]]), 1, 1),
        (SamplingParams(allowed_token_ids=[2, 7, 50], min_tokens=3, bad_words_ids=[[50]], suppress_tokens=[7]), 1, 0),
        (SamplingParams(allowed_token_ids=[2, 7, 50], min_tokens=1, bad_words_ids=[[50]]), 1, 1),
    ]
    rows = [Row(p, pl, _tokens(rng, pl, n)) for p, pl, n in settings]

    def hf(r):
        p, procs = r.params, []
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        if p.bad_words_ids:
            procs.append(NoBadWordsLogitsProcessor([list(w) for w in p.bad_words_ids], EOS))
        if p.min_tokens:
            procs += [MinLengthLogitsProcessor(p.min_tokens + r.prompt_len, EOS),
                      MinNewTokensLengthLogitsProcessor(r.prompt_len, p.min_tokens, EOS)]
        if p.allowed_token_ids is not None:
            procs.append(_hf_allowed(r))
        if p.suppress_tokens:
            procs.append(SuppressTokensLogitsProcessor(list(p.suppress_tokens)))
        return procs

    if kind == "beam-logprobs":  # later beam steps are checked per request below
        rows = [r for r in rows if r.num_out == 0]
    scores, out = _check(rows, kind, 80, hf)
    for i, r in enumerate(rows):
        if r.params.allowed_token_ids is not None:
            assert set(torch.nonzero(out[i] > NEG_INF).flatten().tolist()) <= set(r.params.allowed_token_ids)


def test_allowed_token_ids_in_beam_search_is_decided_per_request():
    """Later beam steps: HF revives the allowed tokens only when every beam of the
    request has them all banned (then HF's tensors and tandem's differ: see the
    module docstring of logits_processors); a beam alone in that state stays at -inf."""
    p = SamplingParams(allowed_token_ids=[2, 7, 50], min_tokens=3, bad_words_ids=[[12, 50]], num_beams=3,
                       temperature=0.0)
    rows = [Row(p, 1, [0, 11, 12]), Row(p, 1, [0, 11, 13]), Row(p, 1, [0, 13, 14])]  # beam 0 ends on the bad prefix
    scores, got = _step(rows, "beam-logprobs", 90)
    ids = torch.tensor([r.tokens for r in rows])
    hf = LogitsProcessorList([NoBadWordsLogitsProcessor([[12, 50]], EOS), MinLengthLogitsProcessor(4, EOS),
                              MinNewTokensLengthLogitsProcessor(1, 3, EOS), _hf_allowed(rows[0], num_beams=3)])
    want = hf(ids, scores.clone())
    assert got[0].isneginf().all()
    for i, r in enumerate(rows):
        _assert_row_equal(got[i], want[i], i, r)


# -- presence / frequency penalties (no HF equivalent) -----------------------------------------


def _penalty_reference(r: Row, scores: torch.Tensor) -> torch.Tensor:
    """OpenAI's definition (vLLM's semantics), in float64: logits[t] -= count(t) *
    frequency_penalty + (count(t) > 0) * presence_penalty, counting the output
    tokens only."""
    out = scores.double().clone()
    counts: dict[int, int] = {}
    for t in r.tokens[r.prompt_len:]:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        out[t] -= c * r.params.frequency_penalty + r.params.presence_penalty
    return out


def _penalty_bound(r: Row, scores: torch.Tensor) -> torch.Tensor:
    """How far tandem's float32 result may be from the float64 reference. tandem
    rounds five times in float32 (the two penalties to float32, frequency * count,
    + presence, the subtraction), each by at most EPS32 / 2 of a value no larger in
    magnitude than M = |logit| + |frequency| * count + |presence|; rounding the
    float64 reference to float32 adds EPS32 / 2 * M. So 3 * EPS32 * M; 4 for slack.
    (Independent of thread count: no reductions, only elementwise float32 ops.)"""
    counts = torch.bincount(torch.tensor(r.tokens[r.prompt_len:], dtype=torch.long), minlength=VOCAB).double()
    m = scores.double().abs() + abs(r.params.frequency_penalty) * counts + abs(r.params.presence_penalty) * (counts > 0)
    return 4 * EPS32 * m


@pytest.mark.parametrize("kind", KINDS)
def test_presence_and_frequency_penalties(kind):
    rng = random.Random(9)
    shared = SamplingParams(presence_penalty=1.5, frequency_penalty=0.25)
    settings = [shared, SamplingParams(presence_penalty=-0.7), SamplingParams(frequency_penalty=1.9), shared,
                SamplingParams(), SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0),
                SamplingParams(frequency_penalty=0.1), shared, SamplingParams(presence_penalty=0.3)]
    rows = [Row(p, pl := rng.randint(1, 5), _tokens(rng, pl, rng.randint(0, 20))) for p in settings]
    rows.append(Row(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), 4, [0, 12, 13, 14]))  # no output yet
    scores, out = _step(rows, kind, 100)
    for i, r in enumerate(rows):
        want = _penalty_reference(r, scores[i])
        assert torch.equal(out[i].isneginf(), want.isneginf())
        untouched = want == scores[i].double()
        assert torch.equal(out[i][untouched], scores[i][untouched]), f"row {i}: a token not in the output moved"
        err = (out[i].double() - want).abs()
        assert (err <= _penalty_bound(r, scores[i])).all(), f"row {i}: max error {err.max():.3g}"
    # Prompt tokens are not counted: the row without output tokens is untouched.
    assert torch.equal(out[-1], scores[-1])
    assert _changed_rows(scores, out) == {i for i, r in enumerate(rows[:-1])
                                          if (r.params.presence_penalty or r.params.frequency_penalty) and r.num_out}


# -- the whole chain, in HF's order ------------------------------------------------------------

# HF's order (GenerationMixin._get_logits_processor) of the processors tandem has, for
# a config that sets them all, then the caller's own processors. tandem's documented
# order is the same, except allowed_token_ids (HF: prefix_allowed_tokens_fn) which
# tandem masks first (commutes: every processor before HF's keeps -inf at -inf, and
# the all-banned fallback is applied at HF's position), and presence / frequency
# penalties, which HF lacks: right after the repetition penalty, vLLM's order.
HF_ORDER = [
    "SequenceBiasLogitsProcessor",  # logit_bias
    "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "PrefixConstrainedLogitsProcessor",  # allowed_token_ids
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor",
    "_UserProcessorsAsHF",
]


@pytest.fixture(scope="module")
def hf_model():
    cfg = BartConfig(vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=1,
                     decoder_attention_heads=1, encoder_ffn_dim=8, decoder_ffn_dim=8, max_position_embeddings=64)
    return BartForConditionalGeneration(cfg).eval()


class _PenaltiesAsHF(LogitsProcessor):
    def __init__(self, row: Row):
        self.row = row

    def __call__(self, input_ids, scores):
        return _penalty_reference(self.row, scores[0]).float()[None]


def boost_prompt_end(prompt_ids, output_ids, logits):  # vLLM's three-argument form
    logits[prompt_ids[-1]] += 1.5
    return logits


def ban_last_output(output_ids, logits):  # the two-argument form
    if output_ids:
        logits[output_ids[-1]] = NEG_INF
    return logits


class _UserProcessorsAsHF(LogitsProcessor):
    """``boost_prompt_end`` then ``ban_last_output``, written against HF's input_ids."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[0, input_ids[0, self.prompt_len - 1]] += 1.5
        if input_ids.shape[1] > self.prompt_len:
            scores[0, input_ids[0, -1]] = NEG_INF
        return scores


def _hf_chain(model, r: Row) -> LogitsProcessorList:
    """HF ``generate``'s own processor list for this row's settings (the inverse of
    tandem's generation-config mapping), built by HF's ``_prepare_generated_length``
    and ``_get_logits_processor``, with the presence / frequency reference inserted
    after the repetition penalty."""
    p = r.params
    kw = dict(do_sample=False, num_beams=1, num_return_sequences=1, max_new_tokens=p.max_tokens, eos_token_id=list(EOS),
              decoder_start_token_id=0, pad_token_id=1)
    if p.repetition_penalty != 1.0:
        kw["repetition_penalty"] = p.repetition_penalty
    if p.no_repeat_ngram_size:
        kw["no_repeat_ngram_size"] = p.no_repeat_ngram_size
    if p.bad_words_ids:
        kw["bad_words_ids"] = [list(w) for w in p.bad_words_ids]
    if p.min_length:
        kw["min_length"] = p.min_length
    if p.min_tokens:
        kw["min_new_tokens"] = p.min_tokens
    if p.forced_bos_token_id is not None:
        kw["forced_bos_token_id"] = p.forced_bos_token_id
    if p.forced_eos_token_id:
        kw["forced_eos_token_id"] = list(p.forced_eos_token_id)
    if p.suppress_tokens:
        kw["suppress_tokens"] = list(p.suppress_tokens)
    if p.begin_suppress_tokens:
        kw["begin_suppress_tokens"] = list(p.begin_suppress_tokens)
    if p.logit_bias:
        kw["sequence_bias"] = [[[t], b] for t, b in p.logit_bias]
    gen = GenerationConfig(**kw)
    model._prepare_special_tokens(gen, kwargs_has_attention_mask=True, device="cpu")
    gen = model._prepare_generated_length(
        generation_config=gen, has_default_max_length=False, has_default_min_length=not p.min_length,
        model_input_name="input_ids", input_ids_length=r.prompt_len, inputs_tensor=torch.tensor([[0, 5, 2]]),
    )
    allowed = list(p.allowed_token_ids) if p.allowed_token_ids is not None else None
    user = LogitsProcessorList([_UserProcessorsAsHF(r.prompt_len)] if p.logits_processors else [])
    procs = model._get_logits_processor(
        generation_config=gen, input_ids_seq_length=r.prompt_len, encoder_input_ids=torch.tensor([[0, 5, 2]]),
        prefix_allowed_tokens_fn=(lambda batch_id, ids: allowed) if allowed is not None else None,
        logits_processor=user, device="cpu", model_kwargs={},
    )
    if p.presence_penalty or p.frequency_penalty:
        names = [type(x).__name__ for x in procs]
        at = names.index("RepetitionPenaltyLogitsProcessor") + 1 if "RepetitionPenaltyLogitsProcessor" in names else (
            1 if names[:1] == ["SequenceBiasLogitsProcessor"] else 0)
        procs.insert(at, _PenaltiesAsHF(r))
    return procs


def test_hf_builds_the_processors_in_the_order_tandem_documents(hf_model):
    p = SamplingParams(logit_bias={5: 1.0}, repetition_penalty=1.2, no_repeat_ngram_size=2, bad_words_ids=[[4, 5]],
                       min_length=3, min_tokens=2, allowed_token_ids=[5, 6], forced_bos_token_id=5,
                       forced_eos_token_id=2, suppress_tokens=[9], begin_suppress_tokens=[8],
                       logits_processors=[boost_prompt_end])
    names = [type(x).__name__ for x in _hf_chain(hf_model, Row(p, 2, [0, 5]))]
    assert names == HF_ORDER
    import tandem.core.worker.logits_processors as lp

    documented = " ".join(lp.__doc__.split())
    assert ("Order (HF's where HF has the processor): allowed_token_ids, logit_bias, repetition_penalty, "
            "presence/frequency penalties, no_repeat_ngram_size, bad_words_ids, min_length / min_tokens, "
            "forced_bos_token_id, forced_eos_token_id, suppress_tokens, begin_suppress_tokens, user "
            "``logits_processors``.") in documented


def _assert_chain_row(got: torch.Tensor, want: torch.Tensor, i: int, r: Row, scores: torch.Tensor) -> None:
    """Bit for bit, except after presence / frequency penalties, where only the float64
    reference's rounding differs: ``_penalty_bound`` for the scores the penalties saw
    (a logit bias of at most 3, then a repetition penalty scaling by at most 1.8 =
    max(1.8, 1 / 0.6)), doubled for the user processor's +1.5 after them (one more
    rounding, of a value no larger)."""
    if not (r.params.presence_penalty or r.params.frequency_penalty):
        _assert_row_equal(got, want, i, r)
        return
    assert torch.equal(got.isneginf(), want.isneginf()), f"row {i}: -inf positions differ"
    finite = ~want.isneginf()
    bound = 2 * _penalty_bound(r, (scores.abs() + 3) * 1.8 + 1.5)
    err = (got.double() - want.double()).abs()
    assert (err[finite] <= bound[finite]).all(), f"row {i}: max error {err[finite].max():.3g}"


def _random_params(rng: random.Random, num_out: int, prompt_len: int) -> SamplingParams:
    kw: dict = {}
    on = lambda: rng.random() < 0.35  # noqa: E731
    if on():
        kw["logit_bias"] = {rng.choice(COMMON): rng.uniform(-3, 3), rng.randrange(VOCAB): rng.uniform(-3, 3)}
    if on():
        kw["repetition_penalty"] = rng.choice([0.6, 1.1, 1.3, 1.8])
    if on():
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if on():
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if on():
        kw["no_repeat_ngram_size"] = rng.randint(1, 4)
    if on():
        kw["bad_words_ids"] = [[rng.choice(COMMON)], [rng.choice(COMMON), rng.choice(COMMON)], [rng.choice(EOS)],
                               [rng.choice(COMMON), rng.choice(COMMON), rng.randrange(VOCAB)]]
    if on():
        kw["min_length"] = rng.randint(1, prompt_len + num_out + 3)
    if on():
        kw["min_tokens"] = rng.randint(1, num_out + 3)
    if on():
        kw["allowed_token_ids"] = sorted(set(rng.sample(range(VOCAB), 40) + rng.sample(COMMON + EOS, 3)))
    if on():
        kw["forced_bos_token_id"] = rng.choice(COMMON)
    if on():
        kw["forced_eos_token_id"] = rng.sample(EOS + [40], rng.randint(1, 2))
    kw["max_tokens"] = max(num_out + rng.choice([1, 1, 2, 5]), kw.get("min_tokens", 0))
    if on():
        # Not the forced tokens: HF's GenerationConfig refuses to suppress every forced token.
        forced = {kw.get("forced_bos_token_id")} | set(kw.get("forced_eos_token_id", ()))
        kw["suppress_tokens"] = [t for t in rng.sample(range(VOCAB), 5) + [rng.choice(COMMON)] if t not in forced]
    if on():
        kw["begin_suppress_tokens"] = [rng.choice(EOS), rng.choice(COMMON), rng.randrange(VOCAB)]
    if on():
        kw["logits_processors"] = [boost_prompt_end, ban_last_output]
    return SamplingParams(**kw)


def _chain_rows(seed: int, n: int = 16) -> list[Row]:
    rng = random.Random(seed)
    rows: list[Row] = []
    for _ in range(n):
        pl = rng.choice([1, 1, 2, 3])
        num_out = rng.choice([0, 0, 1, 2, rng.randint(3, 14)])
        if rows and rng.random() < 0.3:  # another request with the same params object
            prev = rng.choice(rows)
            p = prev.params
            pl, num_out = prev.prompt_len, min(prev.num_out, p.max_tokens - 1)
        else:
            p = _random_params(rng, num_out, pl)
        rows.append(Row(p, pl, _tokens(rng, pl, num_out)))
    return rows


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(8))
def test_the_whole_chain_equals_hf_generates_processors(hf_model, kind, seed):
    rows = _chain_rows(seed)
    scores, out = _step(rows, kind, 1000 + seed)
    for i, r in enumerate(rows):
        _assert_chain_row(out[i], _apply(_hf_chain(hf_model, r), r, scores[i]), i, r, scores[i])



@pytest.mark.parametrize("kind", KINDS)
def test_the_chain_where_neighbours_do_not_commute(hf_model, kind):
    """Rows where swapping two neighbouring processors would change the result,
    which random rows rarely hit: forcing overwrites what came before and is
    itself changed by what comes after."""
    pen = SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, forced_eos_token_id=7, max_tokens=4)
    rows = [
        Row(pen, 1, [0, 7, 7, 12]),  # forced EOS overwrites the penalty on an EOS already in the output
        Row(SamplingParams(forced_bos_token_id=0, logits_processors=[boost_prompt_end, ban_last_output]), 1, [0]),
        # The user's ban lands on a forced token, after the forcing.
        Row(SamplingParams(forced_eos_token_id=[7, 12], max_tokens=3,
                           logits_processors=[boost_prompt_end, ban_last_output]), 2, [0, 12, 5, 12]),
        Row(SamplingParams(forced_eos_token_id=2, max_tokens=3, min_tokens=3, suppress_tokens=[40]), 1, [0, 5, 6]),
        Row(SamplingParams(forced_eos_token_id=2, max_tokens=3, allowed_token_ids=[5, 6], min_tokens=3), 1, [0, 5, 6]),
        Row(SamplingParams(logit_bias={12: 2.0}, repetition_penalty=1.8, presence_penalty=1.0), 1, [0, 12, 12]),
        Row(SamplingParams(forced_bos_token_id=12, begin_suppress_tokens=[12], suppress_tokens=[5]), 1, [0]),
    ]
    scores, out = _step(rows, kind, 77)
    for i, r in enumerate(rows):
        _assert_chain_row(out[i], _apply(_hf_chain(hf_model, r), r, scores[i]), i, r, scores[i])
    assert out[0, 7] == 0 and out[1, 0] == 1.5 and out[2, 12] == NEG_INF and out[2, 7] == 0


def test_the_chain_cases_exercise_every_processor(hf_model):
    """None of the chain comparisons above is vacuous for any processor: each one,
    left out of HF's list, changes some row's result."""
    mattered: dict[str, int] = {}
    for seed in range(8):
        rows = _chain_rows(seed)
        scores = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1000 + seed)) * 3.0
        for i, r in enumerate(rows):
            procs = list(_hf_chain(hf_model, r))
            full = _apply(procs, r, scores[i])
            for k, proc in enumerate(procs):
                if not torch.equal(_apply(procs[:k] + procs[k + 1:], r, scores[i]), full):
                    mattered[type(proc).__name__] = mattered.get(type(proc).__name__, 0) + 1
    # HF's MinNewTokens duplicates the MinLength that generate rebuilt from min_new_tokens
    # (same condition), so leaving out either alone changes nothing.
    assert set(mattered) == set(HF_ORDER) - {"MinNewTokensLengthLogitsProcessor"} | {"_PenaltiesAsHF"}, mattered
    assert min(mattered.values()) >= 2, mattered
