"""The compiled decode step (``enforce_eager=False``, tandem/core/worker/compiled_step.py)
against the eager step: the logits of every compiled step against the eager model call
on the same inputs and KV cache, and the greedy tokens against an eager engine's.

Batches: five requests of different lengths with buckets [1, 2, 4]
(``compile_max_batch_size=4``) run at 5 rows (beyond the largest bucket: eager),
4, 3 (padded to 4: the padded row must write no K/V and its logits are dropped),
2 and 1. Compiling takes tens of seconds per bucket on 2 cores, so the default suite
has one BART case with one bucket (5 rows, eager, then 3 rows padded to 4)
traced by Dynamo and AOTAutograd without inductor (``aot_eager``), and the failure
case; inductor itself, every bucket, T5, the demo Whisper and the disk cache are
``slow``.

Tolerance: float32 throughout; the compiled graph runs the same oneDNN GEMMs and the
same attention op, and differs only in how inductor fuses and orders the elementwise
ops and layer norms (a reduction over d_model summed in another order), ~1e-6
relative per layer. 1e-4 of the logits' scale leaves room for that over the layers
while a wrong row, a stale or overwritten KV slot or a dropped bias moves logits by
O(1) of their scale.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tandem import LLM
from tandem.core.worker import compiled_step
from tandem.core.worker.compiled_step import CompiledDecodeStep, buckets_up_to
from tests.helpers import exact_length_greedy, first_tokens, make_bart, make_t5, step_prompts

REL_TOL = 1e-4
LENGTHS = (2, 4, 6, 8, 10)  # max_tokens of the five requests: batches 5, 4, 3, 2, 1
SHORT = (2, 2, 5, 5, 5)  # batches 5, then 3 (padded to 4)


def _prompts(n: int = len(LENGTHS)) -> list[dict]:
    return step_prompts(n)


def _params(lengths=LENGTHS) -> list:
    return exact_length_greedy(lengths)


_tokens = first_tokens


@pytest.fixture
def record_steps(monkeypatch):
    """Every compiled step's logits beside the eager model's on the same inputs (the eager
    call runs after the compiled one and rewrites the same K/V slots)."""
    seen = []
    compiled_call = CompiledDecodeStep.__call__

    def spy(self, input_ids, positions, kv_caches, metadata):
        logits = compiled_call(self, input_ids, positions, kv_caches, metadata)
        if logits is not None:
            hidden = self.model(input_ids, positions, self._no_encoder, self._no_encoder, kv_caches, metadata)
            seen.append((input_ids.shape[0], logits.clone(), self.model.compute_logits(hidden).float()))
        else:
            seen.append((input_ids.shape[0], None, None))
        return logits

    monkeypatch.setattr(CompiledDecodeStep, "__call__", spy)
    return seen


def _check_against_eager(model_dir, prompts, params, tmp_path, record_steps, rows=(5, 4, 3, 2, 1), **kw):
    eager = _tokens(LLM(str(model_dir), dtype="float32", **kw).generate(prompts, params, use_tqdm=False))
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=False, compile_max_batch_size=4,
              compile_cache_dir=str(tmp_path / "cache"), **kw)
    step = llm.llm_engine.worker.runner.compiled
    assert step.buckets == [1, 2, 4]
    compiled = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert step.failed is None
    assert compiled == eager
    seen = [r for r, *_ in record_steps]
    assert set(rows) <= set(seen), seen
    for r, got, want in record_steps:
        if r > 4:
            assert got is None  # beyond the largest bucket: the runner ran it eager
            continue
        assert got.shape == want.shape == (r, want.shape[1])
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=REL_TOL, atol=REL_TOL * scale)
    assert step.compiled_buckets == {step.bucket(r) for r in rows if r <= 4}
    return step


def test_bart_traced_step_matches_eager(tmp_path, record_steps, monkeypatch):
    """The default suite's case: Dynamo and AOTAutograd without inductor's code generation
    (the opaque ops, their fake impls, padding to a bucket, the fallback beyond it), one
    bucket: 5 rows beyond the buckets (eager), then 3 padded to 4. The vocabulary is large
    enough that cpu_gemm="auto" packs the LM head (an opaque op in the graph) while the tiny
    layers stay dense (F.linear, traced as any op)."""
    from tandem.core.layers.linear import LinearBase
    from tandem.core.layers.linear_kernels import DENSE_MAX_WEIGHTS, DenseKernel, PackedCPUKernel, \
        packed_gemm_unsupported

    monkeypatch.setattr(compiled_step, "COMPILER_BACKEND", "aot_eager")
    model_dir = make_bart(tmp_path / "bart", vocab_size=DENSE_MAX_WEIGHTS // 32 + 1)  # d_model 32
    step = _check_against_eager(model_dir, _prompts(), _params(SHORT), tmp_path, record_steps, rows=(5, 3))
    if not packed_gemm_unsupported(torch.device("cpu"), torch.float32):
        assert [type(k) for k in step.kernels] == [PackedCPUKernel]  # the LM head, opaque
        dense = [m.kernel for m in step.model.modules() if isinstance(m, LinearBase)]
        assert dense and all(isinstance(k, DenseKernel) for k in dense)


@pytest.mark.slow
def test_int8_traced_step_matches_eager(tmp_path, record_steps, monkeypatch):
    """int8 quantizes activations per tensor: the padded row must not reach the GEMM
    (it would move the real rows' scale; before the linear op sliced them, the
    tokens differed from eager's)."""
    monkeypatch.setattr(compiled_step, "COMPILER_BACKEND", "aot_eager")
    model_dir = make_bart(tmp_path / "bart")
    _check_against_eager(model_dir, _prompts(), _params(SHORT), tmp_path, record_steps, rows=(5, 3),
                         quantization="int8")


@pytest.mark.slow
def test_bart_compiled_matches_eager(tmp_path, record_steps):
    """Inductor, one bucket (as above): minutes on a loaded 2-core machine."""
    model_dir = make_bart(tmp_path / "bart")
    _check_against_eager(model_dir, _prompts(), _params(SHORT), tmp_path, record_steps, rows=(5, 3))


@pytest.mark.slow
def test_bart_compiled_matches_eager_every_bucket(tmp_path, record_steps):
    model_dir = make_bart(tmp_path / "bart")
    _check_against_eager(model_dir, _prompts(), _params(), tmp_path, record_steps)


@pytest.mark.slow
def test_t5_compiled_matches_eager(tmp_path, record_steps):
    model_dir = make_t5("t5-small", tmp_path / "t5")
    _check_against_eager(model_dir, _prompts(), _params(), tmp_path, record_steps)


@pytest.mark.slow
def test_whisper_compiled_matches_eager(tmp_path, record_steps):
    from tandem.demo_whisper import PATH, SAMPLE_RATE, synthesize

    prompts = [{"encoder_prompt": {"audio": synthesize(w, seed=i), "sampling_rate": SAMPLE_RATE}}
               for i, w in enumerate(["hello world", "three one four", "one two", "world", "four three"])]
    _check_against_eager(PATH, prompts, _params(), tmp_path, record_steps)


def test_compile_failure_falls_back_to_eager(tmp_path, monkeypatch, caplog):
    """A compiler that raises: the step runs eager (the same tokens), the reason is logged
    once, and no later step tries again."""
    calls = []

    def broken_compile(fn, **kwargs):
        def run(*args):
            calls.append(1)
            raise RuntimeError("no C++ compiler here")
        return run

    monkeypatch.setattr(compiled_step.torch, "compile", broken_compile)
    model_dir = make_bart(tmp_path / "bart")
    prompts, params = _prompts(3), _params()[2:]
    eager = _tokens(LLM(str(model_dir), dtype="float32").generate(prompts, params, use_tqdm=False))
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=False, compile_cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=compiled_step.__name__):
        got = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert got == eager
    step = llm.llm_engine.worker.runner.compiled
    assert step.failed == "RuntimeError: no C++ compiler here"
    assert len(calls) == 1
    assert len([r for r in caplog.records if "compiled decode step failed" in r.getMessage()]) == 1


_START = """
import json, sys
from tandem import LLM, SamplingParams
from torch._dynamo.utils import counters
llm = LLM(sys.argv[1], dtype="float32", enforce_eager=False, compile_cache_dir=sys.argv[2])
out = llm.generate([{"prompt_token_ids": [5, 9, 11]}], SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4),
                   use_tqdm=False)
print(json.dumps({"tokens": list(out[0].outputs[0].token_ids), "inductor": dict(counters["inductor"]),
                  "buckets": sorted(llm.llm_engine.worker.runner.compiled.compiled_buckets)}))
"""


@pytest.mark.slow
def test_cache_dir_written_and_reused(tmp_path):
    """A first process writes its compiled graph under compile_cache_dir (an FX graph cache
    miss, then .so files there); a second process with the same directory hits inductor's
    FX graph cache and builds no new .so. Fresh processes, as a restart is: within one
    process inductor's in-memory caches would answer first."""
    import json
    import subprocess
    import sys

    model_dir = make_bart(tmp_path / "bart")
    cache = tmp_path / "cache"

    def start() -> dict:
        # No timeout: a compile under load takes minutes; pytest's own limits apply.
        out = subprocess.run([sys.executable, "-c", _START, str(model_dir), str(cache)], capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def built() -> set:
        return {p for p in cache.rglob("*.so")}

    first = start()
    assert first["buckets"] == [1] and first["inductor"].get("fxgraph_cache_miss", 0) >= 1, first
    so_files = built()
    assert so_files
    second = start()
    assert second["tokens"] == first["tokens"]
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1 and not second["inductor"].get("fxgraph_cache_miss"), \
        second
    assert built() == so_files


def test_buckets():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(4) == [1, 2, 4]
    assert buckets_up_to(24) == [1, 2, 4, 8, 16, 24]


@pytest.mark.parametrize("kw, field", [
    ({"enforce_eager": "no"}, "enforce_eager"),
    ({"compile_max_batch_size": 0}, "compile_max_batch_size"),
    ({"compile_cache_dir": 3}, "compile_cache_dir"),
])
def test_bad_compile_options_are_refused(tmp_path, kw, field):
    from tandem.core.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(make_bart(tmp_path / "bart")), **kw)


def test_enforce_eager_builds_no_compiled_step(tmp_path):
    llm = LLM(str(make_bart(tmp_path / "bart")), dtype="float32")
    assert llm.llm_engine.worker.runner.compiled is None


def test_a_bucket_s_first_compile_says_so_at_info(tmp_path, monkeypatch, caplog):
    """A bucket's first call (the cold compile, tens of seconds on 2 cores) logs a line
    when it starts, naming the bucket and the cache, and one with its seconds when done;
    later calls of that bucket log nothing."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # restored afterwards (the step sets it)
    monkeypatch.setattr(compiled_step.torch, "compile",
                        lambda fn, **kwargs: lambda model, ids, *args: torch.zeros(ids.shape[0], 3))
    step = CompiledDecodeStep(torch.nn.Linear(1, 1), torch.device("cpu"), max_rows=4, cache_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger=compiled_step.__name__):
        for rows in (3, 4, 1, 3):
            assert step(torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long), [], None).shape \
                == (rows, 3)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert [line.split(" in ")[0] for line in lines] == [
        f"compiling the decode step for 4 rows (once per batch bucket; cache {tmp_path})",
        "compiled the decode step for 4 rows",
        f"compiling the decode step for 1 rows (once per batch bucket; cache {tmp_path})",
        "compiled the decode step for 1 rows",
    ]
    assert lines[1].endswith(" s")
