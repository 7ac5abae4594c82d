"""A plugin that registers a new ``model_type`` with transformers' AutoConfig, so that
checkpoints whose config.json names it load without trust_remote_code."""

import json
import shutil

import pytest
from transformers import CONFIG_MAPPING, AutoConfig

from custom_config_plugin import MODEL_TYPE, TandemTestBartConfig
from helpers import TINY_DIMS
from tandem import LLM, SamplingParams
from tandem.plugins import reset_registries
from test_plugin_manager import ep, run

ARCH = "TandemTestBartForConditionalGeneration"


def _forget_model_type() -> None:
    # AutoConfig's registrations are process-wide and transformers has no public way to undo
    # one; dropping it keeps this test's "before" state true and other tests unaffected.
    getattr(CONFIG_MAPPING, "_extra_content", {}).pop(MODEL_TYPE, None)


@pytest.fixture(autouse=True)
def _clean():
    _forget_model_type()
    reset_registries()
    yield
    _forget_model_type()
    reset_registries()


def test_plugin_hook_teaches_autoconfig_the_model_type(tmp_path):
    TandemTestBartConfig(**TINY_DIMS, vocab_size=96, architectures=[ARCH]).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == MODEL_TYPE
    with pytest.raises(ValueError, match=MODEL_TYPE):
        AutoConfig.from_pretrained(tmp_path)

    _, models, _ = run([ep("test-bart", "custom_config_plugin")])
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is TandemTestBartConfig and config.d_model == TINY_DIMS["d_model"]
    cls, arch = models.resolve(config.architectures)
    assert arch == ARCH and cls.__name__ == "BartForConditionalGeneration"
    run([ep("test-bart", "custom_config_plugin")])  # hooks run again: not an error
    assert type(AutoConfig.from_pretrained(tmp_path)) is TandemTestBartConfig


def test_llm_serves_a_checkpoint_of_the_new_type(bart_dir, tmp_path, monkeypatch):
    # The same weights as bart_dir under the plugin's model_type and architecture name: tandem must
    # load them (trust_remote_code=False) and generate what it generates for the plain BART.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(bart_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type=MODEL_TYPE, architectures=[ARCH])
    (ckpt / "config.json").write_text(json.dumps(config))
    # Installed the way pip would: a dist-info whose entry point names the plugin module.
    dist = tmp_path / "site" / "tandem_test_bart-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tandem-test-bart\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tandem.plugins]\ntest-bart = custom_config_plugin\n")
    with pytest.raises(ValueError, match=f"model type `{MODEL_TYPE}`"):
        LLM(model=str(ckpt), dtype="float32", device="cpu")  # not installed yet: transformers does not know the type

    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    reset_registries()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["the rain in spain", "a cat sat"]
    got = LLM(model=str(ckpt), dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    assert isinstance(AutoConfig.from_pretrained(ckpt), TandemTestBartConfig)
    want = LLM(model=str(bart_dir), dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
