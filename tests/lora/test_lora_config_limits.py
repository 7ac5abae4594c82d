"""Reading an adapter is bounded whatever its files hold (issue 50): ``rank_pattern`` /
``alpha_pattern`` keys that make a backtracking matcher run for minutes, configs nested
past the JSON parser's recursion limit, and weights whose shapes do not fit are each
refused (or matched) quickly, with an error naming the bad value, before any tensor is
read. PEFT's own semantics of the patterns are ``test_lora_failures.test_scalings_are_peft_own``'s."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from helpers import make_bart
from lora_adapters import edit_config, make_adapter
from tandem import LLM, LoRARequest, SamplingParams
from tandem.lora import adapter as adapter_mod
from tandem.lora.adapter import AdapterError, read_adapter

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_bart(tmp_path_factory.mktemp("lora_limits") / "base", seed=4, with_tokenizer=False)


@pytest.fixture
def adapter(base, tmp_path):
    return make_adapter(base, tmp_path / "a", ["q_proj", "fc1"], r=4)


# Python's re takes 9.7 s on the first against a bart-base module name and does not finish
# the second in 60 s: each holds the GIL all along, freezing every thread of the engine's process.
BACKTRACKING = ["(.*)(.*)(.*)(.*)(.*)(.*)(.*)(.*)X", "(.*)*X"]


@pytest.mark.parametrize("key", BACKTRACKING)
def test_backtracking_pattern_keys_are_matched_at_once(adapter, key):
    """The keys match no module (no name ends in X), as PEFT would find: the adapter is read
    with the config's r everywhere. In a subprocess, so the old matcher fails by the timeout
    instead of holding this process."""
    edit_config(adapter, rank_pattern={key: 2}, alpha_pattern={key: 99})
    code = ("import sys; from tandem.lora.adapter import read_adapter; "
            "m = read_adapter(sys.argv[1], 4).modules; "
            "print(sorted({(x.rank, x.scaling) for x in m.values()}))")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code, str(adapter)], capture_output=True, text=True,
                              timeout=120, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading an adapter with the rank_pattern key {key!r} took over 120 s")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[(4, 2.0)]"  # r=4 and lora_alpha=8 from the config
    # The subprocess's own start-up (importing torch) is most of it; the matching is microseconds.
    assert time.monotonic() - start < 100


def test_a_pattern_past_the_time_budget_is_refused_naming_it(adapter, monkeypatch):
    edit_config(adapter, rank_pattern={"fc1": 4})
    monkeypatch.setattr(adapter_mod, "PATTERN_BUDGET_S", 0.0)  # any match now runs past it
    with pytest.raises(AdapterError, match=r"rank_pattern key 'fc1' in adapter_config.json: matching the module "
                                           r"names took longer than 0 s"):
        read_adapter(adapter, 4)


@pytest.mark.parametrize("field, value, words", [
    ("rank_pattern", {"(": 2}, "rank_pattern key '(' in adapter_config.json: not a regular expression"),
    ("alpha_pattern", [["fc1", 2]], "alpha_pattern=[['fc1', 2]] in adapter_config.json: must be an object"),
    ("rank_pattern", {"q" * 600: 2}, "rank_pattern key 'qqqq"),
    ("rank_pattern", {f"m{i}": 2 for i in range(5000)}, "rank_pattern in adapter_config.json has 5000 keys, more "
                                                        "than 4096"),
])
def test_pattern_fields_that_cannot_be_patterns_are_refused(adapter, field, value, words):
    edit_config(adapter, **{field: value})
    with pytest.raises(AdapterError) as e:
        read_adapter(adapter, 4)
    assert words in str(e.value)
    assert len(str(e.value)) < 400  # the bad value is named, not dumped


@pytest.mark.parametrize("depth", [20, 100_000])
def test_a_deeply_nested_config_is_refused_naming_the_field(adapter, depth):
    """20 levels parse, 100,000 are past the JSON parser's recursion limit (a bare
    RecursionError before): both are refused with the field that nests them."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    text = json.dumps(cfg)[:-1] + ', "target_modules": ' + "[" * depth + "]" * depth + "}"
    (adapter / "adapter_config.json").write_text(text)
    words = "adapter_config.json: the value of 'target_modules' nests arrays or objects more than 16 levels deep"
    with pytest.raises(AdapterError, match=words):
        read_adapter(adapter, 4)
    # The server's start-up check of --lora-modules reads the same file.
    from tandem.entrypoints.openai.lora_modules import check_adapter_dir

    with pytest.raises(ValueError, match=words):
        check_adapter_dir(str(adapter), 4)


class _NoReads:
    """safetensors.safe_open whose files give shapes but no tensor (records who asked)."""

    reads: list[str] = []

    def __init__(self, real):
        self.real = real

    def __call__(self, *args, **kwargs):
        handle = self.real(*args, **kwargs)
        outer = self

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                return self.f.get_slice(name)

            def get_tensor(self, name):
                outer.reads.append(name)
                return self.f.get_tensor(name)

        return Handle()


def test_shapes_are_checked_from_the_header_before_any_tensor_is_read(base, tmp_path, monkeypatch):
    """An adapter for a wider model (the 512 MiB case: shapes that cannot fit) is refused by
    its header; the engine's request names the module and both shapes."""
    wide = make_bart(tmp_path / "wide", d_model=64, encoder_attention_heads=2, decoder_attention_heads=2,
                     with_tokenizer=False)
    path = make_adapter(wide, tmp_path / "wide_adapter", ["fc2"])
    no_reads = _NoReads(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", no_reads)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4)
    no_reads.reads = []  # the base model's own weights were read through it too
    out = llm.generate([{"prompt_token_ids": [5, 17, 33]}], GREEDY, lora_request=LoRARequest("wide", 1, str(path)),
                       use_tqdm=False)[0]
    assert out.error is not None and "does not fit the model's layer" in out.error, out.error
    assert "lora_A (4, 64)" in out.error and "its weight is" in out.error, out.error
    assert no_reads.reads == []
    llm.llm_engine.shutdown()


def test_a_dimension_wider_than_any_layer_is_refused_from_the_header(adapter, monkeypatch):
    """Without a model to compare with, a dimension above MAX_FEATURES is still no adapter's."""
    name = "base_model.model.model.encoder.layers.0.fc1"
    save_file({f"{name}.lora_A.weight": torch.zeros(1, adapter_mod.MAX_FEATURES + 1, dtype=torch.bfloat16),
               f"{name}.lora_B.weight": torch.zeros(8, 1, dtype=torch.bfloat16)},
              adapter / "adapter_model.safetensors")
    edit_config(adapter, r=1)
    no_reads = _NoReads(safetensors.safe_open)
    no_reads.reads = []
    monkeypatch.setattr(safetensors, "safe_open", no_reads)
    with pytest.raises(AdapterError, match=r"has shape \(1, 1048577\): 1048577 features, more than any linear layer"):
        read_adapter(adapter, 4)
    assert no_reads.reads == []
