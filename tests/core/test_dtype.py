"""dtype="auto": the CPU-capability branches (both taken on any machine by patching
the detection), the checkpoint's dtype on GPU, and ``$TANDEM_AUTO_DTYPE``, which
overrides what "auto" means and nothing else."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core import dtype as dtype_mod
from tandem.core.config import EngineConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ENV = dtype_mod.AUTO_DTYPE_ENV


@pytest.fixture
def no_override(monkeypatch):
    """The machine's own answer: CI runs the whole suite once with the override set."""
    monkeypatch.delenv(ENV, raising=False)


def _cpu(monkeypatch, *, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


def test_the_variable_is_named_as_documented():
    assert ENV == "TANDEM_AUTO_DTYPE"


@pytest.mark.parametrize("amx, avx512_bf16, expected, evidence", [
    (False, False, torch.float32, "neither avx512_bf16 nor AMX"),
    (False, True, torch.bfloat16, "avx512_bf16"),
    (True, False, torch.bfloat16, "AMX"),
    (True, True, torch.bfloat16, "AMX"),
], ids=["avx2-only", "avx512_bf16", "amx", "amx+avx512_bf16"])
def test_auto_on_cpu_follows_native_bf16(no_override, monkeypatch, bart_dir, amx, avx512_bf16, expected, evidence):
    _cpu(monkeypatch, amx=amx, avx512_bf16=avx512_bf16)
    got, why = dtype_mod.resolve_auto_dtype(str(bart_dir), CPU)
    assert got == expected and evidence in why
    cfg = EngineConfig(model=str(bart_dir), device="cpu")
    assert (cfg.torch_dtype, cfg.dtype_reason) == (got, why)


@pytest.mark.parametrize("value, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                             ("float16", torch.float16)])
@pytest.mark.parametrize("native_bf16", [False, True], ids=["avx2-cpu", "bf16-cpu"])
def test_override_is_what_auto_means_on_any_cpu(monkeypatch, bart_dir, value, expected, native_bf16):
    _cpu(monkeypatch, amx=False, avx512_bf16=native_bf16)
    monkeypatch.setenv(ENV, value)
    got, why = dtype_mod.resolve_auto_dtype(str(bart_dir), CPU)
    assert got == expected and why == f"TANDEM_AUTO_DTYPE={value} overrides auto"
    cfg = EngineConfig(model=str(bart_dir), device="cpu")
    assert cfg.torch_dtype == expected and "TANDEM_AUTO_DTYPE" in cfg.dtype_reason


def test_override_also_replaces_the_checkpoint_dtype_on_gpu(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bart", "torch_dtype": "float16"}))
    monkeypatch.setenv(ENV, "bfloat16")
    assert dtype_mod.resolve_auto_dtype(str(tmp_path), CUDA)[0] == torch.bfloat16
    monkeypatch.delenv(ENV)
    assert dtype_mod.resolve_auto_dtype(str(tmp_path), CUDA)[0] == torch.float16


@pytest.mark.parametrize("written, expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                               ("float32", torch.float32), (None, torch.float32)])
def test_auto_on_gpu_is_the_checkpoints(no_override, tmp_path, written, expected):
    config = {"model_type": "bart"} | ({"torch_dtype": written} if written else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    got, why = dtype_mod.resolve_auto_dtype(str(tmp_path), CUDA)
    assert got == expected and "checkpoint" in why


def test_empty_means_unset(monkeypatch, bart_dir):
    monkeypatch.setenv(ENV, "")
    assert dtype_mod.auto_dtype_override() is None
    monkeypatch.delenv(ENV)
    assert dtype_mod.auto_dtype_override() is None
    assert dtype_mod.auto_dtype_override({ENV: "float16"}) == (torch.float16, "TANDEM_AUTO_DTYPE=float16 overrides auto")


@pytest.mark.parametrize("explicit, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                                ("float16", torch.float16), ("half", torch.float16),
                                                (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("value", ["float32", "bfloat16", "float16"])
def test_override_never_changes_an_explicit_dtype(monkeypatch, bart_dir, explicit, expected, value):
    monkeypatch.setenv(ENV, value)
    cfg = EngineConfig(model=str(bart_dir), device="cpu", dtype=explicit)
    assert cfg.torch_dtype == expected and cfg.dtype_reason == "asked for"


@pytest.mark.parametrize("value", ["bf16", "auto", "float64", "BFLOAT16", " float32"])
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_a_bad_value_is_refused_at_construction_naming_variable_and_value(monkeypatch, bart_dir, value, dtype):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=f"TANDEM_AUTO_DTYPE={value!r}: must be one of float32, bfloat16, float16"):
        EngineConfig(model=str(bart_dir), device="cpu", dtype=dtype)
    with pytest.raises(ValueError, match="TANDEM_AUTO_DTYPE="):
        LLM(model=str(bart_dir), device="cpu", dtype=dtype)


def test_engine_runs_in_the_override_and_logs_why(monkeypatch, bart_dir, caplog):
    monkeypatch.setenv(ENV, "bfloat16")
    with caplog.at_level(logging.DEBUG, logger="tandem"):
        llm = LLM(model=str(bart_dir), device="cpu", num_kv_blocks=32)
    assert llm.engine.kv_caches[0].dtype == torch.bfloat16
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine details"))
    assert "bfloat16 (TANDEM_AUTO_DTYPE=bfloat16 overrides auto) on cpu" in line
    out = llm.generate([{"prompt_token_ids": [0, 5, 6, 2]}], SamplingParams(temperature=0.0, max_tokens=3),
                       use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 3


def test_cli_reports_a_bad_value_in_one_line(bart_dir):
    env = {**os.environ, ENV: "fp8"}
    res = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "generate", "--model", str(bart_dir),
                          "--dtype", "float32", "the rain"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("tandem generate: error: TANDEM_AUTO_DTYPE='fp8'")
