"""dtype="auto" with quantization="int8" is float32, what int8 dynamic quantization
computes in, on any CPU and whatever ``$TANDEM_AUTO_DTYPE`` says; an explicit
16-bit dtype with int8 is refused at construction saying what to use instead."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core import dtype as dtype_mod
from tandem.core.config import EngineConfig

ENV = dtype_mod.AUTO_DTYPE_ENV


def _bf16_cpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)


def test_auto_with_int8_is_float32_on_a_bf16_cpu(monkeypatch, bart_dir):
    monkeypatch.delenv(ENV, raising=False)
    _bf16_cpu(monkeypatch)
    assert EngineConfig(model=str(bart_dir), device="cpu").torch_dtype == torch.bfloat16  # the premise
    cfg = EngineConfig(model=str(bart_dir), device="cpu", quantization="int8")
    assert cfg.torch_dtype == torch.float32 and "int8" in cfg.dtype_reason


@pytest.mark.parametrize("value", ["bfloat16", "float16", "float32"])
def test_the_auto_override_does_not_apply_to_int8(monkeypatch, bart_dir, value):
    monkeypatch.setenv(ENV, value)
    cfg = EngineConfig(model=str(bart_dir), device="cpu", quantization="int8")
    assert cfg.torch_dtype == torch.float32
    assert f"TANDEM_AUTO_DTYPE={value} does not apply to int8" in cfg.dtype_reason


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "half", torch.bfloat16])
def test_an_explicit_16_bit_dtype_with_int8_says_what_to_use(bart_dir, dtype):
    with pytest.raises(ValueError, match=r"with quantization='int8'.*use dtype='float32' or 'auto'"):
        EngineConfig(model=str(bart_dir), device="cpu", dtype=dtype, quantization="int8")


def test_int8_engine_runs_in_float32_under_a_bfloat16_auto_and_logs_why(monkeypatch, bart_dir, caplog):
    monkeypatch.setenv(ENV, "bfloat16")
    _bf16_cpu(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="tandem"):  # the dtype's reason: in the "engine details" block
        llm = LLM(model=str(bart_dir), device="cpu", quantization="int8", num_kv_blocks=32)
    assert llm.engine.kv_caches[0].dtype == torch.float32 and "int8" in llm.engine.worker.linear_kernels
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "float32: int8 dynamic quantization computes in float32" in log
    # The same tokens as an explicit float32 int8 engine: auto changed nothing else.
    ref = LLM(model=str(bart_dir), device="cpu", dtype="float32", quantization="int8", num_kv_blocks=32)
    prompt, params = [{"prompt_token_ids": [0, 5, 6, 2]}], SamplingParams(temperature=0.0, max_tokens=4)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == ref.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def _cli(*args, env):
    return subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env})


@pytest.mark.slow
def test_cli_int8_runs_by_default_where_auto_means_bfloat16(bart_dir):
    res = _cli("generate", "--model", str(bart_dir), "--device", "cpu", "--quantization", "int8", "--max-tokens", "3",
               "the rain", env={ENV: "bfloat16"})
    assert res.returncode == 0, res.stderr
    res = _cli("generate", "--model", str(bart_dir), "--device", "cpu", "--quantization", "int8", "--dtype",
               "bfloat16", "the rain", env={ENV: "bfloat16"})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem generate: error: dtype='bfloat16' with quantization='int8'")
    assert "use dtype='float32' or 'auto'" in last
