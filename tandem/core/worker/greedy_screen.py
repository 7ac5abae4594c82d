"""The step's side of the LM-head screen (``lm_head_screen``): which steps use it,
and the exact argmax from its int8 logits.

``tandem.core.layers.lm_head_screen`` holds the int8 copy of the head and proves
the bound ``|L_j - Lq_j| <= eps_j``; here a step whose rows are all plain greedy
opens a :class:`StepScreen`, the LM head layer hands it int8 logits, the
processors ban tokens on them as usual, and :meth:`StepScreen.tokens` turns each
row into its float32 argmax:

* ``j*``, the int8 argmax among the tokens not banned, has a true logit of at
  least ``floor = Lq_j* - eps_j*``, so the true maximum is at least ``floor``;
* a token ``j`` can reach ``floor`` only if ``Lq_j >= floor - eps_j >= floor - E``
  (``E``: the row's largest ``eps`` over the vocabulary);
* those candidates (usually one to a few) are computed exactly in float32 and
  the token is their argmax. A row with more than :data:`MAX_CANDIDATES` of them,
  or with no finite score (every token banned, or NaN logits), gets its whole
  float32 row, as without the screen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core.worker.reductions import argmax_rows

# Rows a screened step may have: the int8 pass computes two int8 rows per row, which
# costs about one float32 row while the GEMM reads its weights (few rows) and more
# once it computes (many rows; docs/performance.md "A screened LM head").
MAX_ROWS = 8
# Candidates computed exactly per row; a row with more gets its whole float32 row.
MAX_CANDIDATES = 64


@dataclass
class _Produced:
    layer: object  # the VocabParallelEmbedding / ParallelLMHead that screened
    head: object  # its lm_head_screen.ScreenedHead
    hidden: torch.Tensor
    bias: torch.Tensor | None
    logits: torch.Tensor  # the int8 logits handed back to the model
    pieces: torch.Tensor  # ScreenedHead.approximate's bound pieces


@dataclass
class StepScreen:
    """One step's offer to screen, and what came of it (the worker opens one with
    ``lm_head_screen.screening`` around a step whose rows are all plain greedy)."""

    max_rows: int = MAX_ROWS
    produced: _Produced | None = None
    rows_screened: int = 0
    rows_full: int = 0
    candidates: list[int] = field(default_factory=list)

    def offer(self, layer, head, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Called by the LM head layer: int8 logits for ``hidden`` (None: compute the usual ones)."""
        if self.produced is not None or hidden.dim() != 2 or not 0 < hidden.shape[0] <= self.max_rows:
            return None
        approx, pieces = head.approximate(hidden, bias)
        self.produced = _Produced(layer, head, hidden, bias, approx, pieces)
        return approx

    def tokens(self, scores: torch.Tensor) -> torch.Tensor | None:
        """Each row's token from the processed int8 ``scores`` (banned tokens ``-inf``);
        None unless ``scores`` are this step's screened logits."""
        p = self.produced
        if p is None or scores is not p.logits:
            return None
        rows = scores.shape[0]
        best = argmax_rows(scores)
        top = scores.gather(1, best[:, None]).squeeze(1)
        floor = top.double() - p.head.bound(p.pieces, best[:, None]).squeeze(1)
        threshold = (floor - p.head.bound(p.pieces)).float()
        threshold = torch.nextafter(threshold, torch.full_like(threshold, float("-inf")))  # never rounded up
        row_idx, cols = (scores >= threshold[:, None]).nonzero(as_tuple=True)
        counts = torch.bincount(row_idx, minlength=rows).tolist()
        finite = torch.isfinite(top).tolist()
        ok = [f and 0 < n <= MAX_CANDIDATES for f, n in zip(finite, counts)]
        exact = None
        if any(ok):
            # Only the rows that resolve here: a near-flat row's thousands of candidates are
            # not gathered (it takes its full row below).
            keep = torch.tensor(ok, device=scores.device)[row_idx]
            row_idx, cols = row_idx[keep], cols[keep]
            weight = p.layer.weight
            exact = (weight.index_select(0, cols).float() * p.hidden.index_select(0, row_idx).float()).sum(dim=1)
            if p.bias is not None:
                exact.add_(p.bias.index_select(0, cols))
        out, start = [], 0
        for r in range(rows):
            if ok[r]:
                n = counts[r]
                out.append(int(cols[start + int(torch.argmax(exact[start : start + n]))]))
                self.rows_screened += 1
                self.candidates.append(n)
                start += n
            else:
                out.append(self._full_row(p, r, scores))
                self.rows_full += 1
        return torch.tensor(out, dtype=torch.long, device=scores.device)

    @staticmethod
    def _full_row(p: _Produced, r: int, scores: torch.Tensor) -> int:
        """The row's whole float32 logits with the processors' bans (``-inf`` in scores);
        a row with no finite score is taken as the plain argmax takes it."""
        row = scores[r : r + 1]
        if not bool(torch.isfinite(row).any()):
            return int(argmax_rows(row)[0])
        full = p.layer.head_logits(p.hidden[r : r + 1], p.bias)
        full = torch.where(row == float("-inf"), torch.full_like(full, float("-inf")), full)
        return int(argmax_rows(full)[0])


# A row that needs its whole float32 row pays for the int8 pass on top. Where most rows
# do (a checkpoint whose next-token distributions are near flat), the screen steps
# aside: while the recent share of such rows is above FULL_SHARE_LIMIT, only every
# PROBE_EVERY-th eligible step is screened, to notice when it pays again.
FULL_SHARE_LIMIT = 0.5
PROBE_EVERY = 32


@dataclass
class ScreenStats:
    """What the screen did over an engine's steps (the worker keeps one), and whether
    it is paying (:meth:`wanted`)."""

    steps: int = 0
    rows_screened: int = 0  # rows whose token came from exact candidates
    rows_full: int = 0  # rows that needed their whole float32 row
    candidates: int = 0  # candidates computed exactly, summed over screened rows
    max_candidates: int = 0
    full_share: float = 0.0  # recent share of full rows (a moving average over steps)
    steps_passed: int = 0  # eligible steps not screened because full_share was high

    def add(self, screen: StepScreen) -> None:
        if screen.produced is None:
            return
        self.steps += 1
        self.rows_screened += screen.rows_screened
        self.rows_full += screen.rows_full
        self.candidates += sum(screen.candidates)
        self.max_candidates = max(self.max_candidates, *screen.candidates, 0)
        rows = screen.rows_screened + screen.rows_full
        share = screen.rows_full / rows if rows else 0.0
        # While stepped aside, a probe's result stands alone: one that pays resumes screening.
        self.full_share = share if self.full_share > FULL_SHARE_LIMIT else 0.8 * self.full_share + 0.2 * share

    def wanted(self) -> bool:
        """Whether to screen the next eligible step."""
        if self.full_share <= FULL_SHARE_LIMIT:
            return True
        self.steps_passed += 1
        return self.steps_passed % PROBE_EVERY == 0
