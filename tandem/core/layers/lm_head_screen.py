"""Exact greedy tokens from a cheap int8 pass over the LM head (``lm_head_screen``).

At small batches a float32 decode step is a read of the weights, and the LM head
is the largest of them (bart-base: 154 MB of the decoder's 352 MB a token). A
greedy row needs only the argmax of its logits, and almost all of the vocabulary
only has to be shown to lose. So, for a step whose rows are all plain greedy:

1. int8 logits ``Lq = h_q . W_q`` are computed over the whole vocabulary (a
   quarter of the bytes), together with a bound ``eps[r, j] >= |L - Lq|`` that
   holds for every input, derived below (no statistics, no tuning);
2. the step's processors run on ``Lq`` as they would on the logits: the ones
   allowed here only ban tokens (``-inf``), which does not depend on the values;
3. a token can only be the argmax if ``Lq_j + eps_j >= max_k (Lq_k - eps_k)``;
   those candidates (a handful) are computed exactly in float32 and the token is
   their argmax; a row with more than ``greedy_screen.MAX_CANDIDATES`` candidates
   (a near flat distribution) gets its whole float32 row instead.

This module is the head's side (the int8 copy, the bound, the hook the LM head
layer consults); ``tandem.core.worker.greedy_screen`` is the step's side (which
steps qualify, the candidates, the exact argmax).

The token is therefore the float32 argmax, as without the screen, up to float32
rounding between two candidates (which any change of GEMM kernel has too).

**The bound.** The head's weights are int8 per output row: ``W_j ~ s_j q_j``
(symmetric, ``s_j = max|W_j| / 127``). Each row of activations is two int8 levels,
``h ~ a q1 + b q2`` with ``a = max|h| / 63``, ``q1 = round(h / a)``, ``b = a / 126``
and ``q2 = round((h - a q1) / b)``: all in ``[-63, 63]`` (7-bit, so AVX2's int16
pair sums never saturate). With ``Wq_j = s_j q_j`` and ``hq = a q1 + b q2``::

    L_j - Lq_j = h . (W_j - Wq_j) + (h - hq) . Wq_j
    |L_j - Lq_j| <= ||h|| ||W_j - Wq_j|| + ||h - hq|| ||Wq_j||      (Cauchy-Schwarz)

``||W_j - Wq_j||`` and ``||Wq_j||`` are computed once in float64 at load;
``||h||`` and ``||h - hq||`` per row, in float64. The integer dot products are
exact (int32 accumulation of 7-bit by 8-bit products); what remains is the
float32 rounding of scaling them (a few ulps of ``|a y1| + |b y2|`` and of the
bias), covered by a relative term of 1e-6, five times its worst case.

**The kernel.** PyTorch's ``quantized::linear_dynamic`` quantizes its input per
tensor. Fed integer values in ``[-64, 63]`` and a sentinel row holding both ends,
it picks scale 1 and zero point 64, so its quantization is the identity and its
output is ``s_j`` times the exact integer dot product. That is checked at
construction against an int64 reference (:func:`screen_unsupported`); where it
does not hold the screen is off and the start line says why.
"""

from __future__ import annotations

import contextvars
import warnings
from contextlib import contextmanager

import torch

from tandem.core.layers.linear_kernels import int8_unsupported

# Float32 rounding of the int8 pass's scaling: a few ulps (2^-24 each) of the summed
# magnitudes, five times over.
_ROUNDING = 1e-6

# The step's screen (tandem.core.worker.greedy_screen.StepScreen) while its LM head runs.
_ACTIVE: contextvars.ContextVar[object | None] = contextvars.ContextVar("tandem_lm_head_screen", default=None)


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (int8 values, float32 scales)."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-30).float()
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def _prepack(q: torch.Tensor, scales: torch.Tensor):
    with warnings.catch_warnings():
        # PyTorch 2.13 marks quantized tensor creation deprecated (torchao is the successor).
        warnings.filterwarnings("ignore", message=".*deprecated", category=UserWarning)
        qt = torch._make_per_channel_quantized_tensor(
            q, scales.double(), torch.zeros(q.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qt, None)


def _sentinel(width: int) -> torch.Tensor:
    """The row that makes linear_dynamic's per-tensor range exactly [-64, 63]."""
    row = torch.zeros(1, width)
    row[0, 0], row[0, -1] = -64.0, 63.0
    return row


def _integer_dots(packed, q_rows: torch.Tensor) -> torch.Tensor:
    """``s_j * (q_rows . q_j)`` for integer-valued float rows in [-63, 63]."""
    x = torch.cat([q_rows, _sentinel(q_rows.shape[1])])
    return torch.ops.quantized.linear_dynamic(x, packed, True)[: q_rows.shape[0]]


def screen_unsupported(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why the screen cannot run here (empty: it can): CPU, float32, the int8 kernel,
    and that kernel computing exact integer dot products for the inputs it is given."""
    why = [] if dtype == torch.float32 else [f"dtype {dtype} is not float32 (the screen proves float32 argmaxes)"]
    why += int8_unsupported(device)  # the int8 mode's own check: CPU, the op, an x86 engine
    if why:
        return why
    return _kernel_is_exact()


_EXACT: list[str] | None = None


def _kernel_is_exact() -> list[str]:
    """Run the kernel on extreme and random integer inputs against int64 (once per process)."""
    global _EXACT
    if _EXACT is not None:
        return list(_EXACT)
    g = torch.Generator().manual_seed(0)
    width, out = 96, 40
    q = torch.randint(-127, 128, (out, width), generator=g, dtype=torch.int8)
    q[0] = 127
    q[1] = -127
    scales = torch.rand(out, generator=g) * 1e-2 + 1e-4
    x = torch.randint(-63, 64, (6, width), generator=g).float()
    x[0], x[1], x[2] = 63.0, -63.0, 0.0
    x[3, ::2], x[3, 1::2] = 63.0, -63.0
    try:
        got = _integer_dots(_prepack(q, scales), x).double()
    except Exception as e:  # noqa: BLE001 - any failure means: no screen, with the reason
        _EXACT = [f"the int8 kernel failed its check: {type(e).__name__}: {e}"]
        return list(_EXACT)
    want = (x.long() @ q.long().t()).double() * scales.double()
    err = (got - want).abs() - 4 * 2.0 ** -24 * want.abs()
    _EXACT = [] if bool((err <= 0).all()) else [
        f"quantized::linear_dynamic does not compute exact integer dot products here "
        f"(off by up to {float((got - want).abs().max()):.3g})"]
    return list(_EXACT)


class ScreenedHead:
    """One LM head's int8 copy and the per-row norms its bound needs."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        q, scales = _quantize_rows(w)
        self.packed = _prepack(q, scales)
        # The bound's per-row norms, in float64 a slice at a time (a 256K vocabulary's
        # float64 copy would be gigabytes).
        err, norm = [], []
        for start in range(0, w.shape[0], 4096):
            wq = q[start : start + 4096].double() * scales[start : start + 4096].double()[:, None]
            err.append((w[start : start + 4096].double() - wq).norm(dim=1))
            norm.append(wq.norm(dim=1))
        up = float("inf")
        # Rounded up, so the float32 copies never undercut the float64 norms.
        self.err_norm = torch.nextafter(torch.cat(err).float(), torch.tensor(up))  # ||W_j - Wq_j||
        self.q_norm = torch.nextafter(torch.cat(norm).float(), torch.tensor(up))  # ||Wq_j||
        self.q_norm_max = float(self.q_norm.max())
        self.err_norm_max = float(self.err_norm.max())

    def approximate(self, h: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 logits ``[R, V]`` of float32 rows ``h``, and per row the pieces of the bound:
        ``[R, 3]`` float64 columns ``||h||``, ``||h - hq||`` and the rounding term, so that
        ``|L_j - Lq_j| <= ||h|| err_norm[j] + ||h - hq|| q_norm[j] + rounding`` (:meth:`bound`)."""
        h = h.float()
        broken = ~torch.isfinite(h).all(dim=1)
        if bool(broken.any()):
            # The kernel quantizes all rows per tensor: a NaN/inf row would fail every row's
            # step. Such a row is quantized as zeros; its logits are NaN below.
            h = h.masked_fill(broken[:, None], 0.0)
        a = h.abs().amax(dim=1, keepdim=True) / 63.0
        a = torch.where(a > 0, a, torch.ones_like(a))  # a zero row: q1 = q2 = 0, exact
        q1 = torch.round(h / a).clamp_(-63, 63)
        b = a / 126.0
        q2 = torch.round((h - a * q1) / b).clamp_(-63, 63)
        y = _integer_dots(self.packed, torch.cat([q1, q2]))
        rows = h.shape[0]
        approx = y[:rows].mul_(a).addcmul_(y[rows:], b)  # a y1 + b y2
        if bias is not None:
            approx.add_(bias)
        if bool(broken.any()):  # say NaN, as the float32 logits would
            approx[broken] = float("nan")
        h64, hi, lo = h.double(), a.double() * q1.double(), b.double() * q2.double()
        residual = (h64 - hi - lo).norm(dim=1)  # ||h - hq||
        # |a y1| + |b y2| <= (||a q1|| + ||b q2||) max_j ||Wq_j||: what the scaling rounds.
        rounding = _ROUNDING * ((hi.norm(dim=1) + lo.norm(dim=1)) * self.q_norm_max
                                + (0.0 if bias is None else float(bias.abs().max())))
        return approx, torch.stack([h64.norm(dim=1), residual, rounding], dim=1)

    def bound(self, pieces: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """``eps`` for each row of ``pieces`` (from :meth:`approximate`) at vocabulary
        ``columns`` (``[R, C]``; None: every row's largest over the vocabulary, ``[R]``),
        rounded up past float32's sums (the 1e-5)."""
        if columns is None:
            eps = pieces[:, 0] * self.err_norm_max + pieces[:, 1] * self.q_norm_max + pieces[:, 2]
        else:
            eps = (pieces[:, 0:1] * self.err_norm[columns].double() + pieces[:, 1:2] * self.q_norm[columns].double()
                   + pieces[:, 2:3])
        return eps * (1.0 + 1e-5)


def active():
    """The screen the running step offers its LM head (None: none)."""
    return _ACTIVE.get()


@contextmanager
def screening(screen):
    """Make ``screen`` the one LM heads offer to for the duration (None: none)."""
    token = _ACTIVE.set(screen)
    try:
        yield screen
    finally:
        _ACTIVE.reset(token)
