"""Logits processors with HF ``generate``'s semantics, batched over a step's rows.

Each processor touches only the rows whose request set it, and a processor
no row uses costs one check per distinct ``SamplingParams`` object in the
step (requests usually share a handful). Work is tensor-wide: token masks
are built with ``scatter``, n-gram matches with ``unfold``; Python loops go
over distinct params, n-gram sizes or bad-word widths (and over the rows a
length rule applies to), never over the vocabulary or the bad words. The
processors run on raw logits for greedy and sampled rows and on
log-probabilities for beam rows, as HF does.

Order (HF's where HF has the processor): allowed_token_ids, logit_bias,
repetition_penalty, presence/frequency penalties, no_repeat_ngram_size,
bad_words_ids, min_length / min_tokens, forced_bos_token_id,
forced_eos_token_id, suppress_tokens, begin_suppress_tokens, user
``logits_processors``.

How each maps to HF (``tests/core/test_processors_vs_hf.py`` compares every
row of mixed batches with HF's processors, bit for bit):

* ``logit_bias`` is HF's ``sequence_bias`` of one-token sequences (HF's first
  processor); ``repetition_penalty``, ``no_repeat_ngram_size``,
  ``bad_words_ids`` (one-token words that are an EOS id dropped, as HF drops
  them), ``forced_bos_token_id``, ``forced_eos_token_id`` (at output token
  ``max_tokens - 1``: HF's ``max_length - 1`` with ``max_length`` = decoder
  prompt + ``max_new_tokens``), ``suppress_tokens``, ``begin_suppress_tokens``
  (from the first generated position, one later after a one-token decoder
  prompt with a forced BOS) and the user's processors (HF's custom
  ``logits_processor`` list, which HF appends last) are HF's, in HF's order.
* ``min_tokens`` is HF's ``min_new_tokens`` and, as in HF, takes precedence
  over ``min_length`` when both are set (HF's ``generate`` replaces
  ``min_length`` by ``min_new_tokens`` + decoder prompt). ``min_tokens=0`` is
  "unset": HF's explicit ``min_new_tokens=0`` would also cancel a
  ``min_length``, tandem's does not. Two vLLM additions: ``min_tokens`` also
  bans ``stop_token_ids``, and with ``ignore_eos`` neither bans EOS.
* ``allowed_token_ids`` (vLLM's) is HF's ``prefix_allowed_tokens_fn`` with a
  fixed list. HF applies it after ``min_length``; tandem masks first, which
  commutes (every processor before HF's keeps ``-inf`` at ``-inf``), and at
  HF's place applies HF's rule for a row whose allowed tokens were all banned
  on the way: they get a score of 0, so the constraint still holds. HF decides
  that per request over all its beams: tandem does so on a beam request's
  first step (one row stands for all its beams) and leaves later beam rows
  alone, which differs from HF only when *every* beam of the request has all
  its allowed tokens banned at once (HF revives them; tandem leaves them
  ``-inf``).
* ``presence_penalty`` / ``frequency_penalty`` have no HF equivalent: OpenAI's
  definition as vLLM applies it (counts over the output tokens only, after
  the repetition penalty).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.core.sampling_params import SamplingParams

NEG_INF = -float("inf")
# Requests whose compiled bad words are kept between steps (then the cache starts over).
_BAD_WORDS_CACHE_SIZE = 1024
# Distinct suppress_tokens lists kept as tensors between steps (then the cache starts over).
_TOKEN_TENSORS_CACHE_SIZE = 1024


@dataclass
class _BadWords:
    """One request's bad words: one-token words, and the longer ones by width ``W``
    (a power of two >= prefix length): ``(prefix [M, W] right-aligned, -1 to the
    left of a shorter prefix; last token [M])``."""

    singles: list[int]
    buckets: dict[int, tuple[torch.Tensor, torch.Tensor]]


# torch.ops.tandem_cpu_sampling's ban_repeated_ngrams and ban_repeated_ngrams_rows, once
# install_ngram_op() gave them: the no-repeat n-gram bans of a step's rows in one C++ pass
# (about 15 small tensor ops here otherwise: 0.26 ms a step at 128 rows on the tiny model
# of benchmarks/host_overhead.py); the second reads the worker's token histories in place.
_ngram_op = None
_ngram_rows_op = None
# torch.ops.tandem_cpu_sampling.ban_tokens, once install_token_ban_op() gave it: a token
# list banned in every row in one pass (suppress_tokens, EOS under min_tokens).
_token_ban_op = None


def install_ngram_op(op, rows_op=None) -> None:
    """Make this process's ``no_repeat_ngram_size`` bans on float32 CPU scores take ``op``
    (``torch.ops.tandem_cpu_sampling.ban_repeated_ngrams``) and, where the step's rows
    give their histories in place (``ProcessorRows.history_rows``), ``rows_op``
    (``ban_repeated_ngrams_rows``), with the same bans as the tensor path
    (``tests/core/test_ngram_bans.py``). tandem's cpu_paged backend installs them beside
    the C++ argmax (``tandem/backends/cpu_sampling/ops.py``: the core imports no backend)."""
    global _ngram_op, _ngram_rows_op
    _ngram_op, _ngram_rows_op = op, rows_op


def install_token_ban_op(op) -> None:
    """Make bans of one token list in every row of float32 CPU scores take ``op``
    (``torch.ops.tandem_cpu_sampling.ban_tokens``: ``scores[:, tokens] = -inf``)."""
    global _token_ban_op
    _token_ban_op = op


def _cpu_rows(scores: torch.Tensor) -> bool:
    """Whether the C++ ops take ``scores``: float32 on the CPU with contiguous rows."""
    return scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.dim() == 2 and scores.stride(1) == 1


def needs_history(p: SamplingParams) -> bool:
    """Whether the request's processors read its past tokens (the worker then keeps them)."""
    return bool(
        p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or p.no_repeat_ngram_size
        or any(len(seq) > 1 for seq in p.bad_words_ids)
        or p.logits_processors
    )


def only_bans(p: SamplingParams) -> bool:
    """Whether the request's processors only ban tokens (set ``-inf``) and never change a
    finite score: then they act alike on any approximation of the logits that keeps each
    score finite (the LM-head screen's int8 logits, ``lm_head_screen``). ``allowed_token_ids``
    is left out: when every allowed token was banned it sets them to 0."""
    return not (
        p.logit_bias
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or p.logits_processors
        or p.allowed_token_ids is not None
    )


@dataclass
class ProcessorRows:
    """What the processors know of each row of a step."""

    params: list[SamplingParams]
    num_output_tokens: list[int]
    seq_lens: list[int]  # decoder tokens so far, decoder prompt included
    # The rows' decoder tokens, padded: ``history(rows)`` -> ([len(rows), L] long, lengths);
    # only asked for rows whose params ``needs_history``.
    history: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]] | None = None
    # Per row: True where the request's rows are alternatives of one continuation
    # (``StepMode.joint_rows``); None: no such row.
    joint: list[bool] | None = None
    # The same tokens read in place (None: only ``history``): ``history_rows(rows)`` ->
    # ``(table [*, W] long, table_rows [len(rows)] long, lengths [len(rows)] long)``, row
    # ``rows[j]``'s tokens being ``table[table_rows[j], :lengths[j]]`` (the worker's
    # ``TokenHistories.view``: no gather, and on a steady step no tensor built).
    history_rows: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def prompt_len(self, i: int) -> int:
        return self.seq_lens[i] - self.num_output_tokens[i]


class LogitsProcessors:
    def __init__(self, eos_token_ids: list[int], vocab_size: int | None = None) -> None:
        self.eos_token_ids = list(eos_token_ids)
        # Rows whose user logits processor raised in the last call, with why: their
        # requests end with that error; the rest of the batch goes on.
        self.failures: dict[int, str] = {}
        self._bad_words_cache: dict[int, tuple[SamplingParams, _BadWords]] = {}
        # Banned-id lists as tensors, by value (suppress_tokens).
        self._token_tensors: dict[tuple[int, ...], torch.Tensor] = {}
        # 0, 1, 2, ...: the row ids of a processor that takes every row of a step, sliced.
        self._arange = torch.arange(256)

    def __call__(self, scores: torch.Tensor, rows: ProcessorRows) -> torch.Tensor:
        """Apply every processor the rows ask for to ``scores`` ``[S, vocab]`` in place."""
        self.failures = {}
        groups = _by_params(rows.params)
        self._static(scores, groups, "allowed")
        self._logit_bias(scores, groups)
        self._repetition(scores, groups, rows)
        self._penalties(scores, groups, rows)
        self._no_repeat_ngram(scores, groups, rows)
        self._bad_words(scores, groups, rows)
        self._min_length(scores, groups, rows)
        self._allowed_fallback(scores, groups, rows)
        self._forced(scores, groups, rows)
        self._static(scores, groups, "suppress")
        self._begin_suppress(scores, groups, rows)
        self._user(scores, groups, rows)
        return scores

    # -- token masks ---------------------------------------------------------
    @staticmethod
    def _ban(scores: torch.Tensor, row_ids: list[int], token_ids: list[int] | tuple[int, ...]) -> None:
        if not row_ids or not token_ids:
            return
        dev = scores.device
        r = torch.tensor(row_ids, device=dev).repeat_interleave(len(token_ids))
        t = torch.tensor(token_ids, device=dev).repeat(len(row_ids))
        scores[r, t] = NEG_INF

    @staticmethod
    def _allowed_mask(scores, p: SamplingParams) -> torch.Tensor:
        keep = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
        keep[list(p.allowed_token_ids)] = True
        return keep

    def _static(self, scores, groups, kind: str) -> None:
        if kind == "suppress":
            self._suppress(scores, groups)
            return
        for p, idx in groups:
            if p.allowed_token_ids is not None:
                rows = torch.tensor(idx, device=scores.device)
                scores[rows] = scores[rows].masked_fill(~self._allowed_mask(scores, p), NEG_INF)

    def _suppress(self, scores, groups) -> None:
        """``suppress_tokens``: the rows of every params object with the same list banned
        in one op, the list's ids as a tensor built once (requests whose params differ in
        anything else, a length say, still share their checkpoint's suppress list)."""
        by_value: dict[tuple[int, ...], list[int]] = {}
        for p, idx in groups:
            if p.suppress_tokens:
                rows = by_value.get(p.suppress_tokens)
                if rows is None:
                    by_value[p.suppress_tokens] = list(idx)
                else:
                    rows.extend(idx)
        dev = scores.device
        for token_ids, idx in by_value.items():
            tokens = self._ids_tensor(token_ids, dev)
            if len(idx) == scores.shape[0]:  # every row of the step (rows are distinct): whole columns
                self._ban_columns(scores, tokens)
                continue
            rows = torch.tensor(idx, dtype=torch.long, device=dev)
            scores[rows[:, None], tokens[None, :]] = NEG_INF

    @staticmethod
    def _ban_columns(scores: torch.Tensor, tokens: torch.Tensor) -> None:
        """``scores[:, tokens] = -inf``: the C++ op where installed (one pass over the rows),
        else ``index_fill_``."""
        if _token_ban_op is not None and _cpu_rows(scores):
            _token_ban_op(scores, tokens)
        else:
            scores.index_fill_(1, tokens, NEG_INF)

    def _row_ids(self, idx: list[int], num_rows: int) -> torch.Tensor:
        """``idx`` as a long tensor: a slice of a kept ``arange`` when ``idx`` is every row
        of the step in order (rows are distinct and sorted, as every processor's are)."""
        if len(idx) == num_rows:
            if num_rows > self._arange.shape[0]:
                self._arange = torch.arange(2 * num_rows)
            return self._arange[:num_rows]
        return torch.tensor(idx, dtype=torch.long)

    def _ids_tensor(self, token_ids: tuple[int, ...], dev) -> torch.Tensor:
        """A list of token ids as a tensor on ``dev``, built once per value."""
        tokens = self._token_tensors.get(token_ids)
        if tokens is None or tokens.device != dev:
            if len(self._token_tensors) >= _TOKEN_TENSORS_CACHE_SIZE:
                self._token_tensors.clear()
            tokens = self._token_tensors[token_ids] = torch.tensor(token_ids, dtype=torch.long, device=dev)
        return tokens

    def _allowed_fallback(self, scores, groups, rows: ProcessorRows) -> None:
        """HF's prefix-constrained processor at its place in HF's order: a row whose
        allowed tokens were all banned since the mask gets 0 on them (beam rows only
        on their request's first step: see the module docstring)."""
        for p, idx in groups:
            if p.allowed_token_ids is None:
                continue
            idx = [i for i in idx if not (rows.joint and rows.joint[i]) or rows.num_output_tokens[i] == 0]
            if not idx:
                continue
            r = torch.tensor(idx, device=scores.device)
            keep = self._allowed_mask(scores, p)
            x = scores[r]
            dead = x.amax(dim=1, keepdim=True).isneginf()  # the mask left only allowed tokens
            only_allowed = torch.zeros((), dtype=scores.dtype, device=scores.device).masked_fill(~keep, NEG_INF)
            scores[r] = torch.where(dead, only_allowed, x)

    @staticmethod
    def _logit_bias(scores, groups) -> None:
        for p, idx in groups:
            if p.logit_bias:
                rows = torch.tensor(idx, device=scores.device)[:, None]
                tokens = torch.tensor([t for t, _ in p.logit_bias], device=scores.device)
                bias = torch.tensor([b for _, b in p.logit_bias], dtype=scores.dtype, device=scores.device)
                scores[rows, tokens] += bias

    # -- processors over the past tokens ------------------------------------------
    @staticmethod
    def _occurrence(history: torch.Tensor, lengths: torch.Tensor, vocab: int, start: torch.Tensor | None = None):
        """``[R, vocab]`` counts of each token in each row's tokens ``[start, length)``."""
        cols = torch.arange(history.shape[1], device=history.device)[None, :]
        valid = cols < lengths[:, None]
        if start is not None:
            valid &= cols >= start[:, None]
        ids = torch.where(valid, history, vocab)
        counts = torch.zeros(history.shape[0], vocab + 1, dtype=torch.float32, device=history.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        return counts[:, :vocab]

    def _repetition(self, scores, groups, rows: ProcessorRows) -> None:
        idx = [i for p, g in groups if p.repetition_penalty != 1.0 for i in g]
        if not idx:
            return
        history, lengths = rows.history(idx)
        seen = self._occurrence(history, lengths, scores.shape[1]) > 0
        penalty = torch.tensor([rows.params[i].repetition_penalty for i in idx], dtype=scores.dtype, device=scores.device)[:, None]
        r = torch.tensor(idx, device=scores.device)
        x = scores[r]
        penalized = torch.where(x < 0, x * penalty, x / penalty)
        scores[r] = torch.where(seen.to(scores.device), penalized, x)

    def _penalties(self, scores, groups, rows: ProcessorRows) -> None:
        idx = [i for p, g in groups if p.presence_penalty or p.frequency_penalty for i in g]
        if not idx:
            return
        history, lengths = rows.history(idx)
        start = torch.tensor([rows.prompt_len(i) for i in idx], device=history.device)
        counts = self._occurrence(history, lengths, scores.shape[1], start).to(scores.device)
        dev, dt = scores.device, scores.dtype
        freq = torch.tensor([rows.params[i].frequency_penalty for i in idx], dtype=dt, device=dev)[:, None]
        pres = torch.tensor([rows.params[i].presence_penalty for i in idx], dtype=dt, device=dev)[:, None]
        r = torch.tensor(idx, device=dev)
        scores[r] -= freq * counts + pres * (counts > 0).to(dt)

    def _no_repeat_ngram(self, scores, groups, rows: ProcessorRows) -> None:
        by_n: dict[int, list[int]] = {}
        for p, g in groups:
            n = p.no_repeat_ngram_size
            if n:
                idx = by_n.get(n)
                by_n[n] = g if idx is None else idx + g
        if not by_n:
            return
        if _ngram_op is not None and _cpu_rows(scores):
            self._no_repeat_ngram_op(scores, by_n, len(groups) > 1, rows)
            return
        for n, idx in list(by_n.items()):
            by_n[n] = [i for i in idx if rows.seq_lens[i] >= n]
        for n, idx in by_n.items():
            if not idx:
                continue
            history, lengths = rows.history(idx)
            width = history.shape[1]
            if width < n:
                continue
            cols = torch.arange(width, device=history.device)[None, :]
            history = torch.where(cols < lengths[:, None], history, -1)
            windows = history.unfold(1, n, 1)  # [R, W, n]
            # The last n - 1 tokens of each row, against every window's first n - 1.
            tail_pos = (lengths[:, None] - (n - 1) + torch.arange(n - 1, device=history.device)[None, :]).clamp(min=0)
            tail = history.gather(1, tail_pos)
            match = (windows[:, :, : n - 1] == tail[:, None, :]).all(dim=-1)
            last = windows[:, :, n - 1]
            match &= last >= 0  # windows reaching past the row's tokens
            r, w = match.nonzero(as_tuple=True)
            rows_t = torch.tensor(idx, device=scores.device)
            scores[rows_t[r.to(scores.device)], last[r, w].to(scores.device)] = NEG_INF

    def _no_repeat_ngram_op(self, scores, by_n: dict[int, list[int]], merged: bool, rows: ProcessorRows) -> None:
        """The C++ op's pass: every row of each n at once (the op skips rows shorter than
        n), their tokens read in place where the rows give them so (``history_rows``).
        ``merged``: the rows come from several params objects (sorted here)."""
        for n, idx in by_n.items():
            if merged:
                idx = sorted(idx)
            row_ids = self._row_ids(idx, scores.shape[0])
            if rows.history_rows is not None and _ngram_rows_op is not None:
                table, table_rows, lengths = rows.history_rows(idx)
                _ngram_rows_op(scores, row_ids, table, table_rows, lengths, n)
            else:
                history, lengths = rows.history(idx)
                _ngram_op(scores, row_ids, history, lengths, n)

    def _bad_words(self, scores, groups, rows: ProcessorRows) -> None:
        """HF's ``NoBadWordsLogitsProcessor``. One-token words are a ban per request;
        every multi-token word of every row of the step is matched at once: each
        row's last ``W`` tokens against each of its request's word prefixes,
        right-aligned in ``W`` columns (``W`` a power of two, one pass per ``W``
        present), so the per-step cost is tensor work over (row, word) pairs, and
        Python work is one list extension per request, never per word or sequence."""
        eos = set(self.eos_token_ids)
        multi: list[tuple[_BadWords, list[int]]] = []
        for p, idx in groups:
            if not p.bad_words_ids:
                continue
            compiled = self._compiled_bad_words(p, eos)
            self._ban(scores, idx, compiled.singles)
            if compiled.buckets:
                multi.append((compiled, idx))
        if not multi:
            return
        all_rows = [i for _, idx in multi for i in idx]
        history, lengths = rows.history(all_rows)  # [R, L], [R]
        dev = history.device
        row_ids = torch.tensor(all_rows, device=scores.device)
        widths = sorted({w for c, _ in multi for w in c.buckets})
        for width in widths:
            # Each row's last `width` tokens; -2 before its first (never a token id).
            pos = lengths[:, None] - width + torch.arange(width, device=dev)[None, :]  # [R, W]
            tail = torch.where(pos >= 0, history.gather(1, pos.clamp(min=0)), -2)
            prefixes, lasts, first_word, count = [], [], [], []
            offset, r = 0, 0
            for c, idx in multi:
                bucket = c.buckets.get(width)
                m = 0 if bucket is None else bucket[0].shape[0]
                if m:
                    prefixes.append(bucket[0])
                    lasts.append(bucket[1])
                first_word.extend([offset] * len(idx))
                count.extend([m] * len(idx))
                offset += m
                r += len(idx)
            if not offset:
                continue
            prefix = torch.cat(prefixes).to(dev)  # [M, W], -1 where a word is shorter (any token)
            last = torch.cat(lasts).to(scores.device)  # [M]
            count_t = torch.tensor(count, device=dev)
            # (row, word) pairs: each row against its own request's words only.
            pair_row = torch.repeat_interleave(torch.arange(len(all_rows), device=dev), count_t)  # [P]
            starts = torch.cumsum(count_t, 0) - count_t
            pair_word = torch.tensor(first_word, device=dev)[pair_row] + (
                torch.arange(pair_row.numel(), device=dev) - starts[pair_row])
            p = prefix[pair_word]  # [P, W]
            hit = ((tail[pair_row] == p) | (p < 0)).all(dim=1)  # [P]
            hr, hw = pair_row[hit].to(scores.device), pair_word[hit].to(scores.device)
            scores[row_ids[hr], last[hw]] = NEG_INF

    def _compiled_bad_words(self, p: SamplingParams, eos: set[int]) -> _BadWords:
        """``p``'s bad words as tensors, built once per params object (cached by id,
        with the object kept so the id cannot be reused while cached)."""
        hit = self._bad_words_cache.get(id(p))
        if hit is not None and hit[0] is p:
            return hit[1]
        if len(self._bad_words_cache) >= _BAD_WORDS_CACHE_SIZE:
            self._bad_words_cache.clear()
        # HF drops single-token bad words that are an EOS id.
        words = [list(w) for w in p.bad_words_ids if not (len(w) == 1 and w[0] in eos)]
        singles = [w[0] for w in words if len(w) == 1]
        by_width: dict[int, list[list[int]]] = {}
        for w in words:
            if len(w) > 1:
                width = 1 << (len(w) - 2).bit_length()  # the power of two >= len(w) - 1
                by_width.setdefault(width, []).append(w)
        buckets = {}
        for width, ws in by_width.items():
            prefix = torch.full((len(ws), width), -1, dtype=torch.long)
            for j, w in enumerate(ws):
                prefix[j, width - (len(w) - 1):] = torch.tensor(w[:-1])
            buckets[width] = (prefix, torch.tensor([w[-1] for w in ws], dtype=torch.long))
        compiled = _BadWords(singles, buckets)
        self._bad_words_cache[id(p)] = (p, compiled)
        return compiled

    # -- processors over lengths -------------------------------------------------
    def _min_length(self, scores, groups, rows: ProcessorRows) -> None:
        eos_rows, stop_bans = [], []
        for p, idx in groups:
            if not (p.min_tokens or p.min_length):
                continue
            # HF: min_new_tokens, when set, replaces min_length by min_new_tokens + prompt length.
            if p.min_tokens:
                least, done = p.min_tokens, rows.num_output_tokens
            else:
                least, done = p.min_length, rows.seq_lens
            short = [i for i in idx if done[i] < least]
            if not p.ignore_eos:
                eos_rows += short
            if p.min_tokens and p.stop_token_ids:
                stop_bans += [(i, p.stop_token_ids) for i in short]
        if self.eos_token_ids and len(eos_rows) == scores.shape[0]:
            # Every row (each is listed once: a row has one params object): one column write.
            self._ban_columns(scores, self._ids_tensor(tuple(self.eos_token_ids), scores.device))
        else:
            self._ban(scores, eos_rows, self.eos_token_ids)
        for i, ids in stop_bans:
            self._ban(scores, [i], ids)

    def _forced(self, scores, groups, rows: ProcessorRows) -> None:
        for p, idx in groups:
            if p.forced_bos_token_id is not None:
                for i in idx:
                    if rows.seq_lens[i] == 1:
                        scores[i] = NEG_INF
                        scores[i, p.forced_bos_token_id] = 0.0
            if p.forced_eos_token_id:
                for i in idx:
                    # HF: at length max_length - 1, the last token the length allows.
                    if rows.num_output_tokens[i] == p.max_tokens - 1:
                        scores[i] = NEG_INF
                        scores[i, list(p.forced_eos_token_id)] = 0.0

    def _begin_suppress(self, scores, groups, rows: ProcessorRows) -> None:
        for p, idx in groups:
            if not p.begin_suppress_tokens:
                continue
            hit = []
            for i in idx:
                prompt = rows.prompt_len(i)
                # HF: the first generated position, one later when a forced BOS takes it.
                begin = prompt + 1 if (prompt == 1 and p.forced_bos_token_id is not None) else prompt
                if rows.seq_lens[i] == begin:
                    hit.append(i)
            self._ban(scores, hit, p.begin_suppress_tokens)

    def _user(self, scores, groups, rows: ProcessorRows) -> None:
        for p, idx in groups:
            if not p.logits_processors:
                continue
            history, lengths = rows.history(idx)
            for j, i in enumerate(idx):
                tokens = history[j, : int(lengths[j])].tolist()
                prompt, output = tokens[: rows.prompt_len(i)], tokens[rows.prompt_len(i):]
                row = scores[i].clone()
                try:
                    for fn in p.logits_processors:
                        name = getattr(fn, "__name__", repr(fn))
                        out = fn(prompt, output, row) if _arity(fn) == 3 else fn(output, row)
                        if not isinstance(out, torch.Tensor) or out.shape != row.shape:
                            raise TypeError(f"returned {type(out).__name__}, not a tensor of shape {tuple(row.shape)}")
                        row = out
                except Exception as e:  # the user's code: fail this request, not the batch
                    self.failures[i] = f"logits processor {name!r} raised {type(e).__name__}: {e}"
                    continue
                scores[i] = row


def _by_params(params: list[SamplingParams]) -> list[tuple[SamplingParams, list[int]]]:
    """The rows of each distinct params object, in first-seen order: ``(params, rows)``.
    Equal params are usually one object (``RequestProcessor`` interns them), so one
    object for every row is checked first (``list.count`` over the ids)."""
    if not params:
        return []
    ids = list(map(id, params))
    if ids.count(ids[0]) == len(ids):
        return [(params[0], list(range(len(ids))))]
    by_params: dict[int, tuple[SamplingParams, list[int]]] = {}
    for i, p in enumerate(params):
        entry = by_params.get(id(p))
        if entry is None:
            by_params[id(p)] = (p, [i])
        else:
            entry[1].append(i)
    return list(by_params.values())


def _arity(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return 3 if len(positional) >= 3 else 2
