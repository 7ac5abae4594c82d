"""The decode step as CUDA graphs, piecewise around attention (``enforce_eager=False``
on CUDA; tandem/core/worker/piecewise_backend.py, graph_runner.py), against eager on
the same GPU: greedy tokens token for token, each captured step's logits against the
eager model call on the same inputs and KV cache, and the graphs' counters (each
piece captured once per bucket, replayed on every later step of it).

The same plumbing runs on CPU with the stand-in runner in
tests/core/test_piecewise_step.py; what only a GPU shows is the capture itself
(``torch.cuda.graph``, the shared memory pool) and inductor's CUDA code.

Tolerance: float32 (TF32 off, torch's default for matmuls); the pieces run the same
cuBLAS GEMMs and the same attention op as eager, and inductor's fused kernels reorder
the layer norms' and softmax-free elementwise reductions (~1e-6 relative per layer),
so 1e-4 of the logits' scale, as test_compiled_step.py on CPU; a stale static buffer,
a replay on the wrong inputs or a padded row that wrote K/V moves logits by O(1).
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from helpers import exact_length_greedy, first_tokens, make_bart, step_prompts
from tandem import LLM, SamplingParams
from tandem.core.worker import compiled_step
from tandem.core.worker import worker as worker_mod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REL_TOL = 1e-4
DECODER_LAYERS = 3
PIECES = 2 * DECODER_LAYERS + 1  # around a self- and a cross-attention call per layer
# Decode steps at 5 rows (beyond the buckets [1, 2, 4]: eager), 3 (padded to 4), 1.
LENGTHS = (2, 2, 6, 6, 9)
PROMPTS = step_prompts(len(LENGTHS))
PARAMS = exact_length_greedy(LENGTHS)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    return make_bart(tmp_path_factory.mktemp("bart") / "ckpt", decoder_layers=DECODER_LAYERS)


_tokens = first_tokens


@pytest.fixture
def record_steps(monkeypatch):
    """Each captured step's logits as returned (kept without a copy: they must outlive
    the later replays), beside the eager model's on the same inputs."""
    seen = []
    call = compiled_step.CompiledDecodeStep.__call__

    def spy(self, input_ids, positions, kv_caches, metadata):
        logits = call(self, input_ids, positions, kv_caches, metadata)
        if logits is None:
            seen.append((input_ids.shape[0], None, None))
            return None
        hidden = self.model(input_ids, positions, self._no_encoder, self._no_encoder, kv_caches, metadata)
        seen.append((input_ids.shape[0], logits, self.model.compute_logits(hidden).float()))
        return logits.clone()  # the sampler writes bans into what it gets

    monkeypatch.setattr(compiled_step.CompiledDecodeStep, "__call__", spy)
    return seen


def test_cuda_graph_step_matches_eager(bart, tmp_path, record_steps, caplog):
    eager_llm = LLM(str(bart), device="cuda", dtype="float32")
    eager = _tokens(eager_llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    del eager_llm
    gc.collect()
    with caplog.at_level(logging.INFO, logger=worker_mod.__name__):
        llm = LLM(str(bart), device="cuda", dtype="float32", enforce_eager=False, compile_max_batch_size=4,
                  compile_cache_dir=str(tmp_path / "cache"))
    assert "decode steps: CUDA graphs, piecewise around attention (batch buckets [1, 2, 4]" in caplog.text
    step = llm.llm_engine.worker.runner.compiled
    assert step.piecewise is not None and step.device.type == "cuda"
    got = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert step.failed is None
    assert got == eager

    rows = [r for r, *_ in record_steps]
    assert rows == [5, 3, 3, 3, 3, 1, 1, 1], rows
    for r, logits, want in record_steps:
        if r > 4:
            assert logits is None
            continue
        assert logits.is_cuda and logits.shape == want.shape == (r, want.shape[1])
        scale = want.abs().max().item()
        torch.testing.assert_close(logits, want, rtol=REL_TOL, atol=REL_TOL * scale)

    # Bucket 4: 4 steps, bucket 1: 3; each piece warmed up on a bucket's first step,
    # captured on its second (then replayed), replayed on every later one.
    for graph in step.piecewise.graphs:
        assert len(graph.compute) == PIECES and len(graph.attention) == PIECES - 1
    stats = step.piecewise.stats
    assert (stats.warmups, stats.captures, stats.replays) == (2 * PIECES, 2 * PIECES, (3 + 2) * PIECES)
    runners = [g.module.__dict__[name] for g in step.piecewise.graphs for name in g.compute]
    assert all(r.graph is not None for r in runners)  # a torch.cuda.CUDAGraph each


def test_cuda_graph_step_greedy_batches(bart, tmp_path):
    """More requests than the largest bucket, arriving together and finishing apart:
    every bucket's graphs, then the same engine again (replays), token for token
    against eager."""
    prompts = [{"prompt_token_ids": [4 + (7 * i) % 80, 9, 5 + i, 30 + i % 11][: 2 + i % 3]} for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * (i % 5), min_tokens=4 + 3 * (i % 5))
              for i in range(12)]
    eager_llm = LLM(str(bart), device="cuda", dtype="float32", max_num_seqs=8)
    eager = _tokens(eager_llm.generate(prompts, params, use_tqdm=False))
    del eager_llm
    gc.collect()
    llm = LLM(str(bart), device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=False,
              compile_max_batch_size=8, compile_cache_dir=str(tmp_path / "cache"))
    step = llm.llm_engine.worker.runner.compiled
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == eager
    replays = step.piecewise.stats.replays
    assert step.piecewise.stats.captures > 0
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == eager
    assert step.failed is None
    # At most one capture per piece and bucket over both runs; the second run replayed.
    assert step.piecewise.stats.captures <= PIECES * len(step.buckets)
    assert step.piecewise.stats.replays > replays
