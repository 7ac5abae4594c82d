"""``speculative_config``: vLLM's shape, checked at construction with errors that
name the key and the bad value, and the same on the command line."""

from __future__ import annotations

import argparse

import pytest

from tandem.core.engine_args import add_cli_args, from_cli_args
from tandem.core.speculative_config import SpeculativeConfig


def test_ngram_config_parses_with_defaults():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 5, 1)
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')  # the CLI's JSON text
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (2, 3, 1)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method='eagle' is not known \(known: ngram, draft_model\)"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens=0: must be an integer in \[1, 64\]"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, r"num_speculative_tokens=2.0"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"num_speculative_tokens=True"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, r"prompt_lookup_max=-1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "prompt_lookup_min=3 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "key 'lookahead' is not an option"),
    ({"model": "/ckpt/draft"}, "num_speculative_tokens is required"),
    ({"model": "", "num_speculative_tokens": 2}, "model='': method 'draft_model' needs the draft checkpoint"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None: method 'draft_model' needs"),
    ({"model": "/ckpt/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
     "key 'prompt_lookup_max' is not an option of method 'draft_model'"),
    ("{not json", "not a JSON object"),
    ([1, 2], r"speculative_config=\[1, 2\]: must be None or a dict"),
])
def test_bad_configs_name_the_key_and_value(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)


def test_draft_model_config_parses():
    c = SpeculativeConfig.parse({"model": "/ckpt/draft", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/ckpt/draft", 3)
    c = SpeculativeConfig.parse('{"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 2}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "org/draft", 2)


def test_cli_flag_takes_json():
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    kwargs = from_cli_args(args)
    assert SpeculativeConfig.parse(kwargs["speculative_config"]).num_speculative_tokens == 3
    assert from_cli_args(parser.parse_args([]))["speculative_config"] is None
