"""``no_repeat_ngram_size`` bans by the C++ op (``tandem/backends/cpu_sampling``, over
gathered histories and reading them in place) against the processors' tensor path, and
all against a plain-Python reading of HF's rule: the
same scores, bit for bit, over random histories with repeats, every n, rows too short to
ban and rows left out."""

import random

import pytest
import torch

from tandem.core.sampling_params import SamplingParams
from tandem.core.worker import logits_processors
from tandem.core.worker.logits_processors import LogitsProcessors, ProcessorRows


def _reference(scores, rows_hist, n):
    """HF's NoRepeatNGramLogitsProcessor, written out: every n-gram of the row's tokens
    whose first n - 1 equal its last n - 1 bans its last token."""
    out = scores.clone()
    for i, toks in rows_hist.items():
        if len(toks) < n:
            continue
        tail = toks[len(toks) - (n - 1):] if n > 1 else []
        for w in range(len(toks) - n + 1):
            if toks[w:w + n - 1] == tail:
                out[i, toks[w + n - 1]] = float("-inf")
    return out


def _case(seed, rows=24, vocab=40):
    rng = random.Random(seed)
    hist = {}
    for i in range(rows):
        length = rng.choice([0, 1, 2, 3, 5, 17, 60])
        small = rng.random() < 0.5  # few distinct ids: many repeated n-grams
        hist[i] = [rng.randrange(3 if small else vocab) for _ in range(length)]
    return hist


def _run(hist, params, vocab=40, rows=None):
    idx_rows = list(hist) if rows is None else rows
    scores = torch.randn(len(hist), vocab, generator=torch.Generator().manual_seed(len(hist)))
    width = max(1, max(len(t) for t in hist.values()))

    def history(idx):
        h = torch.full((len(idx), width), 7, dtype=torch.long)  # stale ids past each row's length
        for j, i in enumerate(idx):
            h[j, :len(hist[i])] = torch.tensor(hist[i], dtype=torch.long)
        return h, torch.tensor([len(hist[i]) for i in idx], dtype=torch.long)

    # The same tokens in place (ProcessorRows.history_rows, the cpp_rows path): row i at a
    # shuffled row of a wider table, stale ids past its length.
    place = list(range(len(hist) + 3))
    random.Random(len(hist)).shuffle(place)
    table = torch.full((len(place), width + 2), 7, dtype=torch.long)
    for i, toks in hist.items():
        table[place[i], :len(toks)] = torch.tensor(toks, dtype=torch.long)

    def history_rows(idx):
        return (table, torch.tensor([place[i] for i in idx], dtype=torch.long),
                torch.tensor([len(hist[i]) for i in idx], dtype=torch.long))

    ps = [params[i] if i in idx_rows else SamplingParams(temperature=0.0) for i in range(len(hist))]
    seq_lens = [len(hist[i]) for i in range(len(hist))]
    procs = LogitsProcessors(eos_token_ids=[])
    return scores.clone(), procs(scores, ProcessorRows(ps, [0] * len(hist), seq_lens, history,
                                                       history_rows=history_rows))


@pytest.fixture(params=["tensor", "cpp", "cpp_rows"])
def path(request, monkeypatch):
    """tensor: the processors' tensor ops; cpp: the C++ op over gathered histories;
    cpp_rows: the C++ op reading the histories in place (``history_rows``)."""
    if request.param != "tensor":
        from tandem.backends.cpu_sampling import ops

        try:
            ops.load()
        except ops.CPUOpUnavailable as e:
            pytest.skip(f"the C++ ops cannot be built here: {e}")
        monkeypatch.setattr(logits_processors, "_ngram_op", torch.ops.tandem_cpu_sampling.ban_repeated_ngrams)
        rows_op = torch.ops.tandem_cpu_sampling.ban_repeated_ngrams_rows if request.param == "cpp_rows" else None
        monkeypatch.setattr(logits_processors, "_ngram_rows_op", rows_op)
    else:
        monkeypatch.setattr(logits_processors, "_ngram_op", None)
    return request.param


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_bans_equal_hf_rule(path, n, seed):
    hist = _case(seed)
    params = {i: SamplingParams(temperature=0.0, no_repeat_ngram_size=n) for i in hist}
    before, after = _run(hist, params)
    assert torch.equal(after, _reference(before, hist, n))


def test_rows_of_other_params_and_mixed_sizes(path):
    hist = _case(99)
    rows = [i for i in hist if i % 3]  # the others have no n-gram ban
    params = {i: SamplingParams(temperature=0.0, no_repeat_ngram_size=2 + i % 2) for i in rows}
    before, after = _run(hist, params, rows=rows)
    expect = before.clone()
    for n in (2, 3):
        expect = _reference(expect, {i: hist[i] for i in rows if 2 + i % 2 == n}, n)
    assert torch.equal(after, expect)


def _ops_or_skip() -> None:
    from tandem.backends.cpu_sampling import ops

    try:
        ops.load()
    except ops.CPUOpUnavailable as e:
        pytest.skip(f"the C++ ops cannot be built here: {e}")


def test_the_op_refuses_bad_input():
    _ops_or_skip()
    op = torch.ops.tandem_cpu_sampling.ban_repeated_ngrams
    scores = torch.zeros(2, 5)
    hist = torch.tensor([[1, 2, 1, 9]])
    with pytest.raises(RuntimeError, match="out of the vocabulary"):
        op(scores, torch.tensor([0]), hist, torch.tensor([4]), 1)  # bans token 9 of a 5-token vocabulary
    with pytest.raises(RuntimeError, match="out of range"):
        op(scores, torch.tensor([5]), hist, torch.tensor([3]), 2)
    with pytest.raises(RuntimeError, match="length"):
        op(scores, torch.tensor([0]), hist, torch.tensor([5]), 2)


def test_the_rows_op_refuses_bad_input():
    _ops_or_skip()
    op = torch.ops.tandem_cpu_sampling.ban_repeated_ngrams_rows
    scores = torch.zeros(2, 5)
    table = torch.tensor([[1, 2, 1, 9], [1, 1, 1, 1]])
    with pytest.raises(RuntimeError, match="out of the vocabulary"):
        op(scores, torch.tensor([0]), table, torch.tensor([0]), torch.tensor([4]), 1)
    with pytest.raises(RuntimeError, match="table row"):
        op(scores, torch.tensor([0]), table, torch.tensor([2]), torch.tensor([3]), 2)
    with pytest.raises(RuntimeError, match="length"):
        op(scores, torch.tensor([1]), table, torch.tensor([1]), torch.tensor([5]), 2)


def test_ban_tokens_equals_index_fill():
    """The every-row token ban (suppress_tokens, EOS under min_tokens) against index_fill_."""
    _ops_or_skip()
    op = torch.ops.tandem_cpu_sampling.ban_tokens
    scores = torch.randn(9, 50)
    tokens = torch.tensor([3, 0, 49, 3, 17])
    got = scores.clone()
    op(got, tokens)
    assert torch.equal(got, scores.clone().index_fill_(1, tokens, float("-inf")))
    with pytest.raises(RuntimeError, match="out of the vocabulary"):
        op(got, torch.tensor([50]))
