"""The ``tandem`` command line."""

import json
import subprocess
import sys

from tandem import LLM, SamplingParams


def tandem(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", *args], input=stdin, capture_output=True, text=True
    )


def test_generate_json_reads_stdin_and_matches_the_library(bart_dir):
    res = tandem("generate", "--model", str(bart_dir), "--json", "--max-tokens", "6", "the rain in spain", "-",
                 stdin="red sun\n\nold king\n")
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["the rain in spain", "red sun", "old king"]
    ref = LLM(model=str(bart_dir), device="cpu").generate(
        [r["prompt"] for r in records], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False
    )
    for r, o in zip(records, ref):
        assert r["token_ids"] == o.outputs[0].token_ids and r["text"] == o.outputs[0].text
        assert r["error"] is None


def test_generate_reports_bad_input_and_bad_backend(bart_dir):
    res = tandem("generate", "--model", str(bart_dir), "--max-tokens", "500", "the rain")
    assert res.returncode == 1 and "[error]" in res.stdout and "max_tokens (500)" in res.stdout
    res = tandem("generate", "--model", str(bart_dir), "--backend", "nope", "the rain")
    assert res.returncode == 2 and "attention_backend='nope'" in res.stderr


def test_demo_reverses_words():
    res = tandem("demo")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5/5 right" in res.stdout
    assert "output: mat the on sat cat the" in res.stdout
