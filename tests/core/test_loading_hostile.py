"""Hostile checkpoints refused at LLM(...), each naming what is wrong: a weight file linked
from outside the folder, weights a cast would change (int/bool, out of range, NaN/inf),
special token ids outside the vocabulary, and JSON nested too deeply to read."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.core.checkpoint import WeightLoadError, checkpoint_files
from tandem.core.loader import MAX_JSON_DEPTH, check_generation_token_ids, check_model_config, load_hf_config
from tandem.core.weight_loading import SKIP_CHECKS_ENV, check_weight_values

TENSOR = "model.encoder.layers.0.fc1.weight"


def copy_of(tmp_path: Path, bart_dir: Path, name: str = "m") -> Path:
    d = tmp_path / name
    shutil.copytree(bart_dir, d)
    return d


def load(d: Path, dtype: str = "float32") -> LLM:
    return LLM(model=str(d), dtype=dtype, device="cpu")


def serves(llm: LLM) -> bool:
    out = llm.generate({"prompt_token_ids": [0, 5, 6, 2]}, SamplingParams(temperature=0.0, max_tokens=3),
                       use_tqdm=False)
    return out[0].error is None


@pytest.fixture(autouse=True)
def _checks_on(monkeypatch):
    monkeypatch.delenv(SKIP_CHECKS_ENV, raising=False)


# -- the unsharded weight file as a link ----------------------------------------------


def test_single_weight_file_linked_from_outside_the_folder_is_refused(tmp_path, bart_dir):
    d = copy_of(tmp_path, bart_dir)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(d / "model.safetensors", outside)
    (d / "model.safetensors").symlink_to(outside)
    match = (rf"weight file {re.escape(str(d / 'model.safetensors'))}, a link to {re.escape(str(outside))}, "
             rf"which is outside the checkpoint folder {re.escape(str(d))}")
    with pytest.raises(WeightLoadError, match=match):
        checkpoint_files(d)
    with pytest.raises(WeightLoadError, match=match):
        load(d)


def test_pytorch_bin_linked_from_outside_is_refused_too(tmp_path, bart_dir):
    from transformers import BartForConditionalGeneration

    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(bart_dir / "config.json", d)
    outside = tmp_path / "weights.bin"
    torch.save(BartForConditionalGeneration.from_pretrained(bart_dir).state_dict(), outside)
    (d / "pytorch_model.bin").symlink_to(outside)
    with pytest.raises(WeightLoadError, match=r"weight file .*pytorch_model\.bin, a link to .*weights\.bin, which is "
                       r"outside the checkpoint folder"):
        load(d)


def test_a_sharded_index_linked_from_outside_is_refused(tmp_path, bart_dir):
    from transformers import BartForConditionalGeneration

    d = tmp_path / "sharded"
    BartForConditionalGeneration.from_pretrained(bart_dir).save_pretrained(d, max_shard_size="20KB")
    outside = tmp_path / "index.json"
    shutil.move(d / "model.safetensors.index.json", outside)
    (d / "model.safetensors.index.json").symlink_to(outside)
    with pytest.raises(WeightLoadError, match=r"weight index .*model\.safetensors\.index\.json, a link to .*index\.json"):
        checkpoint_files(d)


def test_links_inside_the_folder_and_the_hub_cache_layout_still_load(tmp_path, bart_dir):
    d = copy_of(tmp_path, bart_dir)
    (d / "blobs").mkdir()
    shutil.move(d / "model.safetensors", d / "blobs" / "abc")
    (d / "model.safetensors").symlink_to(Path("blobs") / "abc")
    assert serves(load(d))
    # models--x/snapshots/<rev>/model.safetensors -> ../../blobs/<hash>, as huggingface_hub stores it
    repo = tmp_path / "models--x"
    snap, blobs = repo / "snapshots" / "rev1", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(p for p in bart_dir.iterdir() if p.is_file())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert serves(load(snap))


# -- weights a cast would change --------------------------------------------------------


def with_tensor(tmp_path: Path, bart_dir: Path, edit, name: str = "m") -> Path:
    """A copy of the checkpoint whose tensor TENSOR is ``edit(tensor)``."""
    d = copy_of(tmp_path, bart_dir, name)
    state = load_file(d / "model.safetensors")
    state[TENSOR] = edit(state[TENSOR].clone())
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    return d


def poke(value: float):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t[1, 2] = value
        return t
    return edit


@pytest.mark.parametrize("kind, edit", [
    ("int64", lambda t: (t * 100).to(torch.int64)),
    ("int32", lambda t: t.to(torch.int32)),
    ("bool", lambda t: t > 0),
])
def test_integer_and_bool_weights_are_refused(tmp_path, bart_dir, kind, edit):
    d = with_tensor(tmp_path, bart_dir, edit)
    with pytest.raises(WeightLoadError, match=rf"checkpoint tensor '{re.escape(TENSOR)}': has dtype {kind}, which "
                       r"cannot be cast exactly to the parameter's float32"):
        load(d)


@pytest.mark.parametrize("value, shown", [(float("nan"), "NaN"), (float("inf"), "inf"), (float("-inf"), "inf")])
def test_nan_and_inf_weights_are_refused(tmp_path, bart_dir, value, shown):
    d = with_tensor(tmp_path, bart_dir, poke(value))
    with pytest.raises(WeightLoadError, match=rf"checkpoint tensor '{re.escape(TENSOR)}': holds {shown} values"):
        load(d)


def test_values_beyond_the_target_dtype_are_refused_and_load_in_a_wider_one(tmp_path, bart_dir):
    d = with_tensor(tmp_path, bart_dir, poke(70000.0))  # float16 tops out at 65504
    with pytest.raises(WeightLoadError, match=rf"checkpoint tensor '{re.escape(TENSOR)}': holds 70000, beyond the "
                       r"range of the parameter's float16 \(\[-65504, 65504\]\)"):
        load(d, dtype="float16")
    assert serves(load(d, dtype="float32"))
    d = with_tensor(tmp_path, bart_dir, lambda t: poke(-2.0**17)(t).to(torch.bfloat16), name="bf16")
    with pytest.raises(WeightLoadError, match=r"holds -131072, beyond the range of the parameter's float16"):
        load(d, dtype="float16")
    load(d, dtype="bfloat16")


def test_the_value_scan_can_be_skipped_but_not_the_dtype_check(tmp_path, bart_dir, monkeypatch):
    nan = with_tensor(tmp_path, bart_dir, poke(float("nan")))
    ints = with_tensor(tmp_path, bart_dir, lambda t: t.to(torch.int64), name="ints")
    monkeypatch.setenv(SKIP_CHECKS_ENV, "1")
    load(nan)  # what the scan would have refused
    with pytest.raises(WeightLoadError, match=r"has dtype int64"):
        load(ints)


def test_check_weight_values_directly():
    check_weight_values(torch.randn(4, 4), torch.bfloat16)
    check_weight_values(torch.randn(4, 4, dtype=torch.float16), torch.float32)
    check_weight_values(torch.empty(0), torch.float16)
    check_weight_values(torch.arange(5), torch.int64)  # an integer buffer takes integers
    with pytest.raises(ValueError, match=r"has dtype float32, which cannot be cast exactly to the parameter's int64"):
        check_weight_values(torch.randn(3), torch.int64)
    with pytest.raises(ValueError, match=r"holds 300, beyond the range of the parameter's int8"):
        check_weight_values(torch.tensor([1, 300]), torch.int8)
    with pytest.raises(ValueError, match=r"beyond the range of the parameter's float32"):
        check_weight_values(torch.tensor([1e300], dtype=torch.float64), torch.float32)
    check_weight_values(torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn), torch.float16)


def test_clean_checkpoints_still_load_in_every_dtype(bart_dir):
    for dtype in ("float32", "bfloat16", "float16"):
        assert serves(load(bart_dir, dtype=dtype))


# -- special token ids outside the vocabulary --------------------------------------------


def with_json(tmp_path: Path, bart_dir: Path, file: str, name: str = "m", **changes) -> Path:
    d = copy_of(tmp_path, bart_dir, name)
    path = d / file
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))
    return d


CONFIG, GENERATION = ("config.json",), ("generation_config.json",)
BOTH = CONFIG + GENERATION
BAD_IDS = [
    (BOTH, dict(eos_token_id=10**9), r"eos_token_id=1000000000 is not a token id of the vocabulary \[0, 96\) "
                                     r"\(vocab_size=96\)"),
    (BOTH, dict(decoder_start_token_id=-1), r"decoder_start_token_id=-1 is not a token id of the vocabulary \[0, 96\)"),
    (BOTH, dict(eos_token_id=[2, 96]), r"eos_token_id holds 96, which is not a token id of the vocabulary \[0, 96\)"),
    (BOTH, dict(forced_eos_token_id=96), r"forced_eos_token_id=96 is not a token id"),
    (CONFIG, dict(bos_token_id=-5), r"bos_token_id=-5 is not a token id"),
    # transformers keeps neither in a BART config.json (its own type check refuses the string there)
    (GENERATION, dict(forced_bos_token_id=500), r"forced_bos_token_id=500 is not a token id"),
    (GENERATION, dict(decoder_start_token_id="2"), r"decoder_start_token_id='2' is not a token id"),
]


@pytest.mark.parametrize("file, changes, match", [(f, c, m) for files, c, m in BAD_IDS for f in files])
def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, bart_dir, file, changes, match):
    d = with_json(tmp_path, bart_dir, file, **changes)
    with pytest.raises(ValueError, match=rf"{re.escape(file)}: {match}"):
        load(d)


def test_generation_config_lists_are_checked_and_pad_token_id_is_not(tmp_path, bart_dir):
    d = with_json(tmp_path, bart_dir, "generation_config.json", suppress_tokens=[5, 4000])
    with pytest.raises(ValueError, match=r"generation_config.json: suppress_tokens holds 4000, which is not a token id"):
        load(d)
    # Checkpoints on the Hub store pad_token_id=-1; tandem never feeds it, so it is left alone.
    d = with_json(tmp_path, bart_dir, "config.json", name="pad", pad_token_id=-1)
    assert serves(load(d))


def test_the_generation_config_checked_is_the_one_selected(tmp_path, bart_dir):
    d = with_json(tmp_path, bart_dir, "generation_config.json", eos_token_id=10**9)
    from tandem.model_zoo.bart import BartForConditionalGeneration as Bart

    cfg, cpu = load_hf_config(str(d)), torch.device("cpu")
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id=1000000000"):
        check_model_config(Bart, cfg, str(d), torch.float32, cpu, generation_config="auto")
    check_model_config(Bart, cfg, str(d), torch.float32, cpu, generation_config="none")
    check_model_config(Bart, cfg, str(d), torch.float32, cpu, generation_config=str(bart_dir))
    with pytest.raises(ValueError, match=rf"{re.escape(str(d))}/generation_config.json: eos_token_id"):
        check_model_config(Bart, load_hf_config(str(bart_dir)), str(bart_dir), torch.float32, cpu,
                           generation_config=str(d))
    from transformers import GenerationConfig

    gen = GenerationConfig(decoder_start_token_id=-1, lang_to_id={"<|en|>": 3, "<|xx|>": 99})
    with pytest.raises(ValueError, match=r"src: decoder_start_token_id=-1"):
        check_generation_token_ids(Bart, cfg, gen, "src")
    gen.decoder_start_token_id = 2
    with pytest.raises(ValueError, match=r"src: lang_to_id\['<\|xx\|>'\]=99 is not a token id of the vocabulary \[0, 96\)"):
        check_generation_token_ids(Bart, cfg, gen, "src")


# -- JSON nested too deeply --------------------------------------------------------------


def nest(depth: int) -> str:
    return "[" * depth + "]" * depth


def with_deep_json(tmp_path: Path, bart_dir: Path, file: str, depth: int) -> Path:
    d = copy_of(tmp_path, bart_dir, f"deep{depth}")
    text = (d / file).read_text().rstrip()
    assert text.endswith("}")
    (d / file).write_text(text[:-1] + f', "deep": {nest(depth)}}}')
    return d


CONFIG_WHERE = r"model='.*': cannot read config.json: config.json"
GENERATION_WHERE = r"generation_config.json: generation_config.json"


@pytest.mark.parametrize("file, depth, where", [
    ("config.json", 100_000, CONFIG_WHERE),
    ("config.json", 2 * MAX_JSON_DEPTH, CONFIG_WHERE),  # parses, but transformers would recurse past ~450
    ("generation_config.json", 100_000, GENERATION_WHERE),
    ("generation_config.json", 2 * MAX_JSON_DEPTH, GENERATION_WHERE),
    ("tokenizer_config.json", 100_000, r"tokenizer='.*': cannot load: tokenizer_config.json"),
    ("tokenizer.json", 100_000, r"tokenizer='.*': cannot load: tokenizer.json"),
    ("tokenizer.json", 2 * MAX_JSON_DEPTH, r"tokenizer='.*': cannot load: tokenizer.json"),  # past tokenizers' 128
])
def test_json_nested_too_deeply_is_refused_by_name(tmp_path, bart_dir, file, depth, where):
    d = with_deep_json(tmp_path, bart_dir, file, depth)
    with pytest.raises(ValueError, match=rf"{where} nests objects or arrays") as info:
        load(d)
    assert not isinstance(info.value, RecursionError)


def test_a_deep_config_is_a_one_line_cli_error(tmp_path, bart_dir):
    d = with_deep_json(tmp_path, bart_dir, "config.json", 100_000)
    res = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "generate", "--model", str(d),
                          "--device", "cpu", "--dtype", "float32", "the rain"],
                         capture_output=True, text=True, env={**os.environ, "TANDEM_AUTO_DTYPE": ""})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "RecursionError" not in res.stderr
    assert "cannot read config.json: config.json nests objects or arrays too deeply" in res.stderr
