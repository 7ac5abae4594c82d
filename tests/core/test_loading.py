"""Safe loading: bad configs, shard names and checkpoint code fail fast with clear errors."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from helpers import SUBPROCESS_TIMEOUT
from tandem import LLM, SamplingParams
from tandem.core.loader import check_model_config, load_hf_config
from tandem.core.checkpoint import WeightLoadError, checkpoint_files


def edited(tmp_path: Path, bart_dir: Path, name: str = "m", **changes) -> Path:
    """A copy of the fixture checkpoint with ``changes`` written into its config.json."""
    d = tmp_path / name
    shutil.copytree(bart_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# -- config sizes ---------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(encoder_attention_heads=0), r"config.json: encoder_attention_heads=0 must be a positive integer"),
        (dict(decoder_ffn_dim=-1), r"decoder_ffn_dim=-1 must be a positive integer"),
        (dict(vocab_size=0), r"vocab_size=0 must be a positive integer"),
        (dict(d_model=30), r"d_model=30 is not divisible by encoder_attention_heads=4"),
        (dict(decoder_attention_heads=3), r"d_model=32 is not divisible by decoder_attention_heads=3"),
        (dict(activation_function="nope"), r"activation_function='nope' is not one of .*gelu"),
    ],
)
def test_config_sizes_are_checked(tmp_path, bart_dir, changes, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(edited(tmp_path, bart_dir, **changes)), dtype="float32", device="cpu")


def test_layers_the_weights_cannot_hold_fail_before_building(tmp_path, bart_dir):
    d = edited(tmp_path, bart_dir, encoder_layers=100000)
    with pytest.raises(ValueError, match=r"encoder_layers=100000.*implies [\d,]+ parameters.*total [\d,]+ bytes"):
        LLM(model=str(d), dtype="float32", device="cpu")


def test_absurd_width_is_rejected_before_allocation(tmp_path, bart_dir, monkeypatch):
    import tandem.core.loader as loader

    def no_build(*args, **kwargs):
        raise AssertionError("load_model reached")

    monkeypatch.setattr(loader, "load_model", no_build)
    d = edited(tmp_path, bart_dir, d_model=10**7)
    cfg = load_hf_config(str(d))
    from tandem.model_zoo.bart import BartForConditionalGeneration as Bart

    with pytest.raises(ValueError, match=r"d_model=10000000.*implies [\d,]+ parameters"):
        check_model_config(Bart, cfg, str(d), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"d_model=10000000"):
        LLM(model=str(d), dtype="float32", device="cpu")


def test_weights_that_do_not_fit_in_memory_are_rejected(bart_dir, monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1 << 10))
    match = r"model weights \([\d,]+ parameters x 4 bytes.*needs [\d.]+ GiB.*0.00 GiB available"
    with pytest.raises(ValueError, match=match):
        LLM(model=str(bart_dir), dtype="float32", device="cpu")


def test_num_parameters_matches_the_built_model(bart_dir):
    from tandem.core.attention import AttentionType
    from tandem.core.model import ModelContext
    from tandem.model_zoo.bart import BartForConditionalGeneration as Bart
    from tandem.plugins import default_backend_registry

    cpu = torch.device("cpu")
    backend = default_backend_registry().select(
        None, device=cpu, dtype=torch.float32, head_size=8, attn_types=frozenset(AttentionType), block_size=16
    ).backend
    ctx = ModelContext(backend, torch.float32, torch.device("meta"))
    for tied in (True, False):
        cfg = load_hf_config(str(bart_dir))
        cfg.tie_word_embeddings = tied
        with torch.device("meta"):
            model = Bart(cfg, ctx)
        assert Bart.num_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_architectures_must_be_a_list(tmp_path, bart_dir):
    d = edited(tmp_path, bart_dir, architectures="BartForConditionalGeneration")
    with pytest.raises(ValueError, match=r"architectures='BartForConditionalGeneration' must be a list"):
        LLM(model=str(d), dtype="float32", device="cpu")
    d = edited(tmp_path, bart_dir, "m2", architectures=[1])
    with pytest.raises(ValueError, match=r"architectures=\[1\] must be a list of class names"):
        LLM(model=str(d), dtype="float32", device="cpu")


# -- legitimate checkpoints still load ------------------------------------------


def test_fixture_checkpoint_loads(bart_dir):
    out = LLM(model=str(bart_dir), dtype="float32", device="cpu").generate(
        {"prompt_token_ids": [0, 5, 6, 2]}, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )
    assert out[0].error is None and len(out[0].outputs[0].token_ids) >= 1


def test_float16_checkpoint_passes_the_size_check_as_float32(tmp_path, bart_dir):
    from transformers import BartForConditionalGeneration

    d = tmp_path / "half"
    BartForConditionalGeneration.from_pretrained(bart_dir).half().save_pretrained(d)
    shutil.copy(bart_dir / "tokenizer.json", d)
    llm = LLM(model=str(d), dtype="float32", device="cpu")
    out = llm.generate("the rain", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out[0].error is None


# -- shard names ------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_dir(bart_dir, tmp_path_factory) -> Path:
    from transformers import BartForConditionalGeneration

    d = tmp_path_factory.mktemp("sharded") / "ckpt"
    BartForConditionalGeneration.from_pretrained(bart_dir).save_pretrained(d, max_shard_size="20KB")
    shutil.copy(bart_dir / "tokenizer.json", d)
    assert len(list(d.glob("model-*.safetensors"))) > 1
    return d


def sharded_copy(tmp_path: Path, sharded_dir: Path, edit) -> tuple[Path, str]:
    """A copy of the sharded checkpoint whose index ``edit(weight_map, first_shard)`` changed."""
    d = tmp_path / "ckpt"
    shutil.copytree(sharded_dir, d)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    edit(index["weight_map"], first)
    index_path.write_text(json.dumps(index))
    return d, first


def repoint(weight_map: dict, old: str, new: str) -> None:
    for k, v in weight_map.items():
        if v == old:
            weight_map[k] = new


def test_shard_outside_the_folder_is_rejected(tmp_path, sharded_dir):
    d, first = sharded_copy(tmp_path, sharded_dir, lambda m, f: repoint(m, f, "../outside.safetensors"))
    shutil.copy(d / first, tmp_path / "outside.safetensors")  # a real file: only its place is wrong
    match = rf"'\.\./outside\.safetensors'.*outside the checkpoint folder {re.escape(str(d))}"
    with pytest.raises(WeightLoadError, match=match):
        LLM(model=str(d), dtype="float32", device="cpu")


def test_absolute_shard_path_is_rejected(tmp_path, sharded_dir):
    outside = tmp_path / "elsewhere.safetensors"
    d, first = sharded_copy(tmp_path, sharded_dir, lambda m, f: repoint(m, f, str(outside)))
    shutil.copy(d / first, outside)
    match = rf"'{re.escape(str(outside))}'.*outside the checkpoint folder {re.escape(str(d))}"
    with pytest.raises(WeightLoadError, match=match):
        checkpoint_files(d)


def test_shard_symlink_leaving_the_folder_is_rejected(tmp_path, sharded_dir):
    d, first = sharded_copy(tmp_path, sharded_dir, lambda m, f: None)
    outside = tmp_path / "real.safetensors"
    shutil.move(d / first, outside)
    (d / first).symlink_to(outside)
    match = rf"'{first}', a link to {re.escape(str(outside))}.*checkpoint folder {re.escape(str(d))}"
    with pytest.raises(WeightLoadError, match=match):
        checkpoint_files(d)


def test_hub_cache_layout_with_blob_symlinks_loads(tmp_path, sharded_dir):
    # models--x/snapshots/<rev>/<file> -> ../../blobs/<hash>, as huggingface_hub stores downloads
    repo = tmp_path / "models--x"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(sharded_dir.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert len(checkpoint_files(snap)) > 1
    LLM(model=str(snap), dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "index, match",
    [
        ({"weight_map": ["model-00001.safetensors"]}, r"'weight_map' must be a non-empty object.*\['model-00001"),
        ({"weight_map": {}}, r"'weight_map' must be a non-empty object.*got \{\}"),
        ({"metadata": {}}, r"'weight_map' must be a non-empty object.*got None"),
        (["not", "an", "object"], r"'weight_map' must be a non-empty object"),
        ({"weight_map": {"shared.weight": 3}}, r"weight_map\['shared.weight'\]=3 is not a shard file name"),
        ({"weight_map": {"shared.weight": None}}, r"weight_map\['shared.weight'\]=None is not a shard file name"),
    ],
)
def test_malformed_weight_map(tmp_path, sharded_dir, index, match):
    d = tmp_path / "ckpt"
    shutil.copytree(sharded_dir, d)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match=match):
        checkpoint_files(d)


# -- code shipped in a checkpoint -------------------------------------------------

EVIL = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "evil_model"
"""


def add_evil_code(d: Path, marker: Path, **config_changes) -> None:
    (d / "evil.py").write_text(EVIL.format(marker=str(marker)))
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    cfg.update(config_changes, auto_map={"AutoConfig": "evil.EvilConfig", "AutoTokenizer": [None, "evil.EvilTok"]})
    (d / "config.json").write_text(json.dumps(cfg))


def run_llm(model_dir: Path, tmp_path: Path, trust: bool = False) -> subprocess.CompletedProcess:
    """``LLM(model=...)`` in a fresh interpreter that is answered "y" if it asks anything."""
    script = textwrap.dedent(
        f"""
        from tandem import LLM, SamplingParams
        llm = LLM(model={str(model_dir)!r}, dtype="float32", device="cpu", trust_remote_code={trust})
        out = llm.generate({{"prompt_token_ids": [0, 5, 2]}}, SamplingParams(max_tokens=2), use_tqdm=False)
        assert out[0].error is None, out[0].error
        print("LOADED")
        """
    )
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", script], input="y\n", capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env=env
    )


@pytest.mark.slow
def test_checkpoint_code_is_never_run_without_trust_remote_code(tmp_path, bart_dir):
    d, marker = tmp_path / "evil_ckpt", tmp_path / "marker"
    shutil.copytree(bart_dir, d)
    add_evil_code(d, marker, model_type="evil_model")
    proc = run_llm(d, tmp_path)
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert "LLM(trust_remote_code=True)" in proc.stderr and str(d) in proc.stderr
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    assert not marker.exists()
    # The same checkpoint does run its code when trusted: the check above is not vacuous.
    run_llm(d, tmp_path, trust=True)
    assert marker.exists()


def test_known_model_type_with_auto_map_loads_without_running_code(tmp_path, bart_dir):
    d, marker = tmp_path / "bart_with_auto_map", tmp_path / "marker"
    shutil.copytree(bart_dir, d)
    add_evil_code(d, marker)
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTok"]}
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    proc = run_llm(d, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED" in proc.stdout and "auto_map" in proc.stderr
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    assert not marker.exists()
