"""Text with a surrogate code point (JSON's ``"\\ud800"`` without its pair) is refused naming
the field and where the bad character is, offline as the request's ``error`` (the others in the
batch are served) and in ``SamplingParams`` for stop strings; the tokenizer never sees it."""

from __future__ import annotations

import json

import pytest

from tandem import LLM, SamplingParams
from tandem.core.text_checks import check_unicode

LONE = json.loads('"ab\\ud800cd"')  # as a JSON body decodes it: "ab" + U+D800 + "cd"


def test_check_unicode_names_the_field_and_the_first_position():
    check_unicode("plain text, and a pair: " + json.loads('"\\ud83d\\ude00"'), "prompt")  # one code point: fine
    text = "x" * 1000 + "\udfff" + "y" + "\ud800"
    with pytest.raises(ValueError) as e:
        check_unicode(text, "decoder_prompt")
    assert str(e.value).startswith("decoder_prompt: a lone surrogate U+DFFF at character 1000 (of 1003)")
    assert "\udfff" not in str(e.value)  # the message itself stays encodable (a JSON error body, a log line)
    str(e.value).encode("utf-8")


def test_a_prompt_with_a_lone_surrogate_fails_that_request_naming_field_and_position(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    prompts = ["the rain in spain", LONE, {"prompt": LONE}, {"encoder_prompt": "red sun", "decoder_prompt": LONE}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 3
    for out, field in zip(outs[1:], ("prompt", "prompt", "decoder_prompt")):
        want = f"{field}: a lone surrogate U+D800 at character 2 (of 5)"
        assert out.error is not None and out.error.startswith(want), out.error


def test_a_stop_string_with_a_lone_surrogate_is_refused_naming_its_index():
    with pytest.raises(ValueError, match=r"^SamplingParams\.stop\[1\]: a lone surrogate U\+DC00 at character 1 "):
        SamplingParams(stop=["ok", "x\udc00"])
    with pytest.raises(ValueError, match=r"^SamplingParams\.stop: a lone surrogate U\+D800 at character 2 "):
        SamplingParams(stop=LONE)
