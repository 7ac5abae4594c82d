"""The decode step split at its attention calls and run through static buffers
(tandem/core/worker/piecewise_backend.py, graph_runner.py): the CUDA-graph step's
logic, on CPU, with the stand-in runner in place of CUDA graphs.

The stand-in records a piece by allocating its output buffers filled with NaN and
replays it by computing into them, so it keeps what a CUDA graph imposes: inputs
copied into static buffers, outputs that are the same memory every replay,
overwritten by the next. The oracles are the eager model call on the same inputs
and KV cache, and the unsplit compiled step (CompiledDecodeStep, the CPU default).

Tolerance: the pieces and the unsplit graph are traced by the same Dynamo and
AOTAutograd without code generation (``aot_eager``): the same ATen ops in the same
order on the same inputs, so their logits are compared bit for bit. Against eager
the existing compiled-step tests' bound (1e-4 of the logits' scale,
test_compiled_step.py) holds: AOTAutograd's decompositions may reorder a
reduction, while a wrong row, a stale static buffer or an overwritten output moves
logits by O(1) of their scale.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tandem import LLM
from tandem.core.worker import compiled_step, piecewise_backend
from tandem.core.worker import worker as worker_mod
from tandem.core.worker.graph_runner import GraphStats, StandInRunner
from tandem.core.worker.piecewise_backend import piecewise_decode_step, split_at_attention
from tests.helpers import exact_length_greedy, first_tokens, make_bart, step_prompts

REL_TOL = 1e-4
DECODER_LAYERS = 3
# max_tokens of five requests: decode steps at 5 rows (beyond the buckets: eager), then
# 3 rows (padded to 4: warm-up, capture, replays), then 1 row (bucket 1).
LENGTHS = (2, 2, 6, 6, 9)


def _prompts(n: int = len(LENGTHS)) -> list[dict]:
    return step_prompts(n)


def _params(lengths=LENGTHS) -> list:
    return exact_length_greedy(lengths)


_tokens = first_tokens


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    return make_bart(tmp_path_factory.mktemp("bart") / "ckpt", decoder_layers=DECODER_LAYERS)


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled_step, "COMPILER_BACKEND", "aot_eager")


def _engine(bart, tmp_path, runner=StandInRunner):
    """An engine whose decode steps run piecewise through ``runner``; also the unsplit
    compiled step the engine built (``enforce_eager=False`` on CPU)."""
    llm = LLM(str(bart), dtype="float32", enforce_eager=False, compile_max_batch_size=4,
              compile_cache_dir=str(tmp_path / "cache"))
    w = llm.llm_engine.worker
    unsplit = w.runner.compiled
    assert isinstance(unsplit, compiled_step.CompiledDecodeStep) and not hasattr(unsplit, "piecewise")
    step = piecewise_decode_step(w.model, w.device, runner, max_rows=4, cache_dir=str(tmp_path / "cache"))
    w.runner.compiled = step
    return llm, step, unsplit


def test_split_cuts_at_every_attention_call(bart, tmp_path, aot_eager):
    """Two attention calls per decoder layer (self, cross): as many pieces as calls, and
    one more between them; each attention piece holds exactly one call."""
    llm, step, _ = _engine(bart, tmp_path)
    llm.generate(_prompts(3), _params((3, 3, 3)), use_tqdm=False)
    assert step.failed is None
    (graph,) = step.piecewise.graphs  # one bucket (3 rows in 4)
    assert len(graph.attention) == 2 * DECODER_LAYERS
    assert len(graph.compute) == 2 * DECODER_LAYERS + 1
    for name in graph.attention:
        calls = [n for n in graph.module._modules[name].graph.nodes if n.op == "call_function"]
        assert len(calls) == 1 and piecewise_backend.is_attention(calls[0])
    for name in graph.compute:
        assert not any(piecewise_backend.is_attention(n) for n in graph.module._modules[name].graph.nodes)
    # The order alternates compute, attention, compute, ... as the layers run.
    order = [n.target for n in graph.module.graph.nodes if n.op == "call_module"]
    assert order[0::2] == graph.compute and order[1::2] == graph.attention


def test_split_graph_computes_what_the_graph_does():
    """On a plain FX graph with attention calls stubbed by a tensor op: the split module
    returns what the unsplit one does, bit for bit."""

    class Toy(torch.nn.Module):
        def forward(self, x, w):
            h = x @ w
            a = torch.ops.tandem.paged_attention(h.view(2, 1, 4), None, None, h, 0, None, 0, 0, False)
            return (a.view(2, 4).relu() + h,)

    gm = torch.fx.symbolic_trace(Toy())
    split = split_at_attention(gm)
    assert len(split.compute) == 2 and len(split.attention) == 1
    # The attention op needs opaque_context; swap the one attention piece for a stand-in
    # computation, in both modules.
    for node in gm.graph.nodes:
        if piecewise_backend.is_attention(node):
            node.target = torch.ops.aten.mul.Scalar
            node.args = (node.args[0], 2.0)
    gm.recompile()
    att = getattr(split.module, split.attention[0])
    for node in att.graph.nodes:
        if piecewise_backend.is_attention(node):
            node.target = torch.ops.aten.mul.Scalar
            node.args = (node.args[0], 2.0)
    att.recompile()
    x, w = torch.randn(2, 4), torch.randn(4, 4)
    assert torch.equal(split.module(x, w)[0], gm(x, w)[0])


@pytest.fixture
def record(monkeypatch):
    """Each piecewise step's logits AS RETURNED (not cloned here: a step whose logits
    alias a static buffer shows as a later step's values), beside the unsplit compiled
    step's and the eager model's on the same inputs (each rewrites the same K/V slots)."""
    rec = SimpleNamespace(seen=[], unsplit=None)
    call = compiled_step.CompiledDecodeStep.__call__

    def spy(self, input_ids, positions, kv_caches, metadata):
        logits = call(self, input_ids, positions, kv_caches, metadata)
        if getattr(self, "piecewise", None) is None:
            return logits  # the unsplit step, called below
        if logits is None:
            rec.seen.append((input_ids.shape[0], None, None, None))
            return None
        unsplit = call(rec.unsplit, input_ids, positions, kv_caches, metadata) if rec.unsplit else logits
        hidden = self.model(input_ids, positions, self._no_encoder, self._no_encoder, kv_caches, metadata)
        rec.seen.append((input_ids.shape[0], logits, unsplit.clone(), self.model.compute_logits(hidden).float()))
        return logits.clone()  # the sampler writes into the logits it gets (bans): not into the kept ones

    monkeypatch.setattr(compiled_step.CompiledDecodeStep, "__call__", spy)
    return rec


def test_piecewise_step_matches_unsplit_and_eager(bart, tmp_path, aot_eager, record):
    """Every step of a generation (padded rows, a second bucket, steps beyond the buckets)
    against the unsplit compiled step bit for bit and eager within REL_TOL; the tokens
    against an eager engine's; each piece warmed up once, captured once per bucket and
    replayed on every later step of it; and every returned logits tensor still holds
    its own step's values after the later steps replayed the same graphs."""
    eager = _tokens(LLM(str(bart), dtype="float32").generate(_prompts(), _params(), use_tqdm=False))
    llm, step, unsplit = _engine(bart, tmp_path)
    record.unsplit = unsplit
    got = _tokens(llm.generate(_prompts(), _params(), use_tqdm=False))
    assert step.failed is None and unsplit.failed is None
    assert got == eager
    rows = [r for r, *_ in record.seen]
    assert rows == [5, 3, 3, 3, 3, 1, 1, 1], rows
    for r, logits, unsplit_logits, want in record.seen:
        if r > 4:
            assert logits is None  # beyond the largest bucket: eager
            continue
        assert logits.shape == want.shape == (r, want.shape[1])
        assert torch.equal(logits, unsplit_logits)
        scale = want.abs().max().item()
        torch.testing.assert_close(logits, want, rtol=REL_TOL, atol=REL_TOL * scale)
    pieces = 2 * DECODER_LAYERS + 1
    assert len(step.piecewise.graphs) == 2  # buckets 4 and 1
    # Bucket 4: 4 steps (warm-up, capture + replay, 2 replays); bucket 1: 3 steps.
    assert step.piecewise.stats == GraphStats(warmups=2 * pieces, captures=2 * pieces, replays=(3 + 2) * pieces)


@pytest.mark.slow
def test_piecewise_inductor_matches_eager(bart, tmp_path, record):
    """Each piece compiled by inductor (C++ on CPU; minutes on a loaded 2-core machine):
    the tokens against an eager engine's, every step's logits against eager's."""
    eager = _tokens(LLM(str(bart), dtype="float32").generate(_prompts(), _params(), use_tqdm=False))
    llm, step, _ = _engine(bart, tmp_path)
    assert _tokens(llm.generate(_prompts(), _params(), use_tqdm=False)) == eager
    assert step.failed is None
    for r, logits, _, want in record.seen:
        if logits is not None:
            scale = want.abs().max().item()
            torch.testing.assert_close(logits, want, rtol=REL_TOL, atol=REL_TOL * scale)
    assert step.piecewise.stats.captures == 2 * (2 * DECODER_LAYERS + 1)


def test_runner_static_buffers():
    """The runner alone: inputs copied into its own buffers (a parameter read in place),
    outputs that are the same memory every replay, fresh values for fresh inputs, a
    shape other than the captured one refused."""
    weight = torch.randn(4, 4)
    stats = GraphStats()
    runner = StandInRunner(lambda x, w, k: (x @ w * k,), stats, frozenset({weight.data_ptr()}))
    x1, x2, x3 = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    (warm,) = runner(x1, weight, 3)
    assert torch.equal(warm, x1 @ weight * 3) and stats == GraphStats(warmups=1)
    (out2,) = runner(x2, weight, 3)  # capture, then replay
    assert torch.equal(out2, x2 @ weight * 3) and stats == GraphStats(warmups=1, captures=1, replays=1)
    static_x = runner.inputs[0]
    assert static_x.data_ptr() != x2.data_ptr() and runner.inputs[1] is weight
    x2.zero_()  # the caller's tensor is not what the graph reads
    (out3,) = runner(x3, weight, 3)
    assert out3.data_ptr() == out2.data_ptr()  # the static output: overwritten by this replay
    assert torch.equal(out2, x3 @ weight * 3)
    weight.mul_(2)  # a parameter is read in place: an update shows in the next replay
    (out4,) = runner(x3, weight, 3)
    assert torch.equal(out4, x3 @ weight * 3) and stats.replays == 3
    with pytest.raises(ValueError, match=r"input 0 is \(3, 4\)"):
        runner(torch.randn(3, 4), weight, 3)
    with pytest.raises(ValueError, match="input 2 is 4, captured as 3"):
        runner(x3, weight, 4)
    with pytest.raises(ValueError, match="parameter"):
        runner(x3, weight.clone(), 3)


def test_stand_in_keeps_an_input_its_output_views():
    """A piece that returns a view of its input: recording must not overwrite the input."""
    runner = StandInRunner(lambda x: (x.view(4), x * 2), GraphStats(), frozenset(), warmup=0)
    x = torch.arange(4.0).view(2, 2)
    view, doubled = runner(x)
    assert view.tolist() == [0.0, 1.0, 2.0, 3.0] and doubled.tolist() == [[0.0, 2.0], [4.0, 6.0]]


def test_backend_clones_what_leaves_the_graph():
    """The step's outputs outlive the next replay: the backend's callable returns copies."""
    backend = piecewise_backend.PiecewiseBackend("eager", StandInRunner, [])

    def f(x):
        return (x * 2 + 1,)

    gm = torch.fx.symbolic_trace(f)
    run = backend(gm, [torch.randn(3)])
    outs = [run(torch.full((3,), float(i)))[0] for i in range(4)]  # warm-up, capture, 2 replays
    assert [o.tolist() for o in outs] == [[2.0 * i + 1] * 3 for i in range(4)]
    assert backend.stats == GraphStats(warmups=1, captures=1, replays=3)


class _FailingRunner(StandInRunner):
    def _capture(self, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_falls_back_to_eager(bart, tmp_path, aot_eager, caplog):
    """A capture that fails: that step and every later one run eager (the same tokens),
    the reason logged once."""
    eager = _tokens(LLM(str(bart), dtype="float32").generate(_prompts(3), _params((5, 5, 5)), use_tqdm=False))
    llm, step, _ = _engine(bart, tmp_path, runner=_FailingRunner)
    with caplog.at_level(logging.WARNING, logger=compiled_step.__name__):
        got = _tokens(llm.generate(_prompts(3), _params((5, 5, 5)), use_tqdm=False))
    assert got == eager
    assert step.failed is not None and "stream is capturing" in step.failed
    assert len([r for r in caplog.records if "compiled decode step failed" in r.message]) == 1
    assert step.piecewise.stats.captures == 0


@pytest.mark.parametrize("cpu_gemm", ["dense", "packed"])
def test_worker_builds_the_cuda_graph_step_on_cuda(bart, tmp_path, monkeypatch, caplog, cpu_gemm):
    """``enforce_eager=False`` on a CUDA device builds the piecewise CUDA-graph step and
    says so on the start line; on CPU it stays the unsplit compiled step (checked in
    ``_engine``). The CUDA build is swapped for the stand-in here (no GPU), on the CPU
    model: with pre-packed kernels (CPU only; they read the step's real rows in Python,
    which a graph would fix at capture) the worker says why and runs eager."""
    llm = LLM(str(bart), dtype="float32", enforce_eager=False, compile_max_batch_size=4,
              compile_cache_dir=str(tmp_path / "cache"), cpu_gemm=cpu_gemm)
    w = llm.llm_engine.worker
    built = []

    def fake_cuda_step(model, device, **kwargs):
        built.append((device.type, kwargs))
        return piecewise_decode_step(model, torch.device("cpu"), StandInRunner, **kwargs)

    monkeypatch.setattr(worker_mod, "cuda_graph_decode_step", fake_cuda_step)
    monkeypatch.setattr(w, "device", torch.device("cuda"))
    with caplog.at_level(logging.INFO, logger=worker_mod.__name__):
        step = w._compiled_step()
    assert built == [("cuda", {"max_rows": 4, "cache_dir": str(tmp_path / "cache")})]
    if cpu_gemm == "packed":
        assert step is None
        assert "decode steps run eager: pre-packed linear kernels on cuda" in caplog.text
        return
    assert step is not None and step.piecewise is not None and not step.kernels
    assert "decode steps: CUDA graphs, piecewise around attention (batch buckets [1, 2, 4]" in caplog.text
