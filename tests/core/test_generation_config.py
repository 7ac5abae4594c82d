"""Request defaults from a checkpoint's generation config: reading it as HF does,
laying explicit fields over it, resolving lengths per request."""

import logging

import pytest

from tandem import SamplingParams
from tandem.core.generation_config import load_generation_defaults, merge_params, resolve_lengths


def _defaults(tmp_path, **fields):
    from transformers import BartConfig, GenerationConfig

    GenerationConfig(**fields).save_pretrained(tmp_path)
    return load_generation_defaults(str(tmp_path), BartConfig())


def test_explicit_fields_are_recorded_and_kept_by_replace():
    p = SamplingParams(3, 0.5, max_tokens=7)
    assert p.explicit_fields == {"n", "temperature", "max_tokens"}
    q = p.replace(seed=4)
    assert q.explicit_fields == {"n", "temperature", "max_tokens", "seed"} and q.seed == 4
    assert SamplingParams().explicit_fields == frozenset()
    assert SamplingParams(max_tokens=7) == SamplingParams(max_tokens=7, n=1)  # equality ignores explicitness


def test_hf_global_defaults_fill_what_the_file_leaves_unset(tmp_path):
    d = _defaults(tmp_path, do_sample=True, eos_token_id=[2, 5])
    assert (d.params.temperature, d.params.top_k, d.params.top_p, d.params.max_tokens) == (1.0, 50, 1.0, 20)
    assert d.eos_token_ids == (2, 5)
    d = _defaults(tmp_path, max_length=60, num_beams=3, early_stopping="never")
    assert (d.params.max_tokens, d.params.max_length, d.params.num_beams, d.params.temperature) == (None, 60, 3, 0.0)
    assert d.params.early_stopping == "never"


def test_settings_tandem_does_not_apply_are_named(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.core.generation_config"):
        d = _defaults(tmp_path, do_sample=True, typical_p=0.5, encoder_no_repeat_ngram_size=2)
    assert any("typical_p=0.5" in r.message and "encoder_no_repeat_ngram_size=2" in r.message for r in caplog.records)
    assert set(d.ignored) == {"typical_p=0.5", "encoder_no_repeat_ngram_size=2"}


def test_without_a_file_the_model_config_is_read(tmp_path):
    from transformers import BartConfig

    d = load_generation_defaults(str(tmp_path), BartConfig(eos_token_id=2))
    assert d.source.startswith("config.json") and d.params.temperature == 0.0 and d.eos_token_ids == (2,)


BEAMS = SamplingParams(num_beams=4, length_penalty=2.0, max_tokens=None, max_length=30, min_length=5)


@pytest.mark.parametrize(
    "request_params, expect",
    [
        (SamplingParams(max_tokens=9), dict(num_beams=4, max_tokens=9, max_length=None, length_penalty=2.0)),
        (SamplingParams(temperature=0.7), dict(num_beams=1, temperature=0.7, max_length=30)),
        (SamplingParams(top_p=0.9), dict(num_beams=1, top_p=0.9)),
        (SamplingParams(top_k=-1), dict(num_beams=4)),  # a filter set to "off" asks for nothing
        (SamplingParams(stop=["."]), dict(num_beams=1)),
        (SamplingParams(n=2), dict(num_beams=4, n=2)),
        (SamplingParams(temperature=0.0), dict(num_beams=4)),
    ],
)
def test_explicit_fields_override_only_what_they_set(request_params, expect):
    merged = merge_params(BEAMS, request_params)
    for name, value in expect.items():
        assert getattr(merged, name) == value, name
    assert merged.explicit_fields == request_params.explicit_fields


def test_explicit_beams_turn_default_sampling_off():
    sampling = SamplingParams(temperature=0.8, top_k=50)
    merged = merge_params(sampling, SamplingParams(num_beams=3))
    assert (merged.num_beams, merged.temperature, merged.top_k) == (3, 0.0, -1)


def test_a_conflict_with_a_default_names_where_it_came_from():
    with pytest.raises(ValueError, match=r"n=6.*num_beams.*from gen.json"):
        merge_params(BEAMS, SamplingParams(n=6), "gen.json")


def test_min_tokens_from_defaults_yield_to_an_explicit_max_tokens():
    merged = merge_params(SamplingParams(min_tokens=10, max_tokens=20), SamplingParams(max_tokens=4))
    assert (merged.min_tokens, merged.max_tokens) == (4, 4)


def test_lengths_resolve_against_the_decoder_prompt():
    p = merge_params(BEAMS, SamplingParams())
    assert resolve_lengths(p, prompt_len=2, positions_left=100).max_tokens == 28
    # A default beyond the positions is capped; an explicit one is an error naming it.
    assert resolve_lengths(p, prompt_len=2, positions_left=10).max_tokens == 10
    with pytest.raises(ValueError, match=r"max_tokens \(50\)"):
        resolve_lengths(merge_params(BEAMS, SamplingParams(max_tokens=50)), prompt_len=2, positions_left=10)
    with pytest.raises(ValueError, match="max_length=30.*31 tokens"):
        resolve_lengths(p, prompt_len=31, positions_left=100)
    # Unset on both sides: everything the positions allow.
    assert resolve_lengths(SamplingParams(max_tokens=None), 3, 40).max_tokens == 40
