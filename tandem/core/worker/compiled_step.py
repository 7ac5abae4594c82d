"""The decoder's decode step as a ``torch.compile``d graph (issue 40).

A decode step is one where every scheduled row has one new token, each returns
one row of logits and no encoder runs: the model call is then the decoder
stack plus the LM head over ``[rows, d_model]``, the same code every step. That
call is compiled (inductor) once per shape bucket: the rows are padded up to
the smallest bucket that holds them (powers of two up to ``max_rows``), padded
rows carry token 0 at position 0, the attention op hands only the real rows to
the backend (so padded rows write no K/V), and their logits are dropped. The
backend's attention runs as one opaque op per layer, and each pre-packed linear
kernel as another (``layers/opaque_ops.py``); they read the step's metadata and
the kernels from :func:`opaque_context`.

Eager is the fallback, never an error: a step with more rows than the largest
bucket runs eager, and the first failure to compile or run a compiled graph is
logged once and turns compiling off for the process's engine (the step is then
run eager, so its outputs are those of an eager step).

Compiled artifacts (inductor's FX graph cache and AOTAutograd's cache) go to
``cache_dir`` (``TORCHINDUCTOR_CACHE_DIR`` for the process), so a second start
loads the compiled kernels instead of generating and building them; Dynamo
still traces the model on each start.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from tandem.core.attention import AttentionMetadata
from tandem.core.layers.attention import Attention
from tandem.core.layers.embedding import VocabParallelEmbedding
from tandem.core.layers.linear import LinearBase
from tandem.core.layers.linear_kernels import _Opaque
from tandem.core.layers.opaque_ops import opaque_context
from tandem.core.model import EncoderDecoderModel

logger = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 32
_RECOMPILE_LIMIT = 64
# torch.compile's backend. Tests swap in "aot_eager" (Dynamo and AOTAutograd, the opaque
# ops' fake impls, no code generation: seconds instead of minutes on 2 cores).
COMPILER_BACKEND = "inductor"


def default_cache_dir() -> str:
    """``$TORCHINDUCTOR_CACHE_DIR`` where the user set one, else tandem's own under
    ``$XDG_CACHE_HOME`` (default ``~/.cache``)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "tandem" / "inductor")


def buckets_up_to(max_rows: int) -> list[int]:
    """Powers of two below ``max_rows``, then ``max_rows`` itself."""
    sizes, n = [], 1
    while n < max_rows:
        sizes.append(n)
        n *= 2
    return sizes + [max_rows]


def _decode_logits(model: EncoderDecoderModel, input_ids, positions, kv_caches, no_encoder):
    # attn_metadata is None: inside the graph every attention layer is the opaque op,
    # which reads the step's metadata from opaque_context.
    hidden = model(input_ids, positions, no_encoder, no_encoder, kv_caches, None)
    return model.compute_logits(hidden).float()


class CompiledDecodeStep:
    """Runs decode steps through compiled graphs; ``__call__`` returns None where the
    caller must run the step eager."""

    def __init__(self, model: EncoderDecoderModel, device: torch.device, *, max_rows: int = DEFAULT_MAX_ROWS,
                 cache_dir: str | None = None, backend=None) -> None:
        self.model = model
        self.device = device
        self.buckets = buckets_up_to(max_rows)
        self.cache_dir = cache_dir or default_cache_dir()
        Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache_dir
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        for i, layer in enumerate(self.layers):
            layer.opaque_index = i
        self.kernels = []
        for m in model.modules():
            kernel = m.kernel if isinstance(m, LinearBase) else getattr(m, "logits_kernel", None) \
                if isinstance(m, VocabParallelEmbedding) else None
            if isinstance(kernel, _Opaque):
                kernel.opaque_index = len(self.kernels)
                self.kernels.append(kernel)
        self.failed: str | None = None  # why compiling was turned off
        self.compiled_buckets: set[int] = set()
        # backend: torch.compile's (default COMPILER_BACKEND); piecewise_backend.py's splits
        # the graph at its attention calls for CUDA graphs.
        self._fn = torch.compile(_decode_logits, backend=backend or COMPILER_BACKEND, dynamic=False)
        self._no_encoder = torch.empty(0, dtype=torch.long, device=device)
        self._padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def bucket(self, rows: int) -> int | None:
        for b in self.buckets:
            if b >= rows:
                return b
        return None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: AttentionMetadata) -> torch.Tensor | None:
        """Logits ``[rows, vocab]`` (float32) of a decode step, or None: run it eager."""
        rows = input_ids.shape[0]
        bucket = self.bucket(rows)
        if self.failed is not None or bucket is None:
            return None
        if bucket == rows:
            ids, pos = input_ids, positions
        else:
            if bucket not in self._padded:
                self._padded[bucket] = (torch.zeros(bucket, dtype=torch.long, device=self.device),
                                        torch.zeros(bucket, dtype=torch.long, device=self.device))
            ids, pos = self._padded[bucket]
            ids[:rows] = input_ids
            pos[:rows] = positions
        # A bucket's first call traces and compiles it: ~10-60 s on a small CPU, seconds where
        # the kernels come from the cache dir. Said at INFO, so a start never looks stuck.
        first = bucket not in self.compiled_buckets
        if first:
            logger.info("compiling the decode step for %d rows (once per batch bucket; cache %s)", bucket,
                        self.cache_dir)
            started = time.perf_counter()
        try:
            # One graph per bucket and per engine in the process (Dynamo counts them per code
            # object); past the limit Dynamo would run eager unannounced: raise instead.
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True), \
                    opaque_context(metadata, self.layers, self.kernels):
                logits = self._fn(self.model, ids, pos, kv_caches, self._no_encoder)
        except Exception as e:  # noqa: BLE001 - any failure: this step and every later one run eager
            self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            logger.warning("compiled decode step failed (%s); decode steps run eager from now on", self.failed,
                           exc_info=True)
            return None
        if first:
            logger.info("compiled the decode step for %d rows in %.1f s", bucket, time.perf_counter() - started)
        self.compiled_buckets.add(bucket)
        return logits[:rows]
