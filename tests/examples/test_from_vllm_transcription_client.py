"""examples/from_vllm/openai_transcription_client.py against a real ``tandem serve`` of
the shipped demo Whisper on 127.0.0.1: vLLM's client calls (the ``openai`` client, a
plain transcription and a stream read from ``chunk.choices``) run with only the server
changed, and the ``openai`` client's own reading of the same stream (OpenAI's
``transcript.text.*`` events) still works. Every text is checked against offline
``LLM.transcribe`` on the same audio with the same sampling fields."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tandem import LLM
from tandem.demo_whisper import PATH as DEMO

pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from test_serve import TIMEOUT, _start, _stop  # noqa: E402 - the served-process helpers of the serve tests

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "from_vllm" / "openai_transcription_client.py"
EXPECTED = {"three_one_four.wav": "three one four one five nine", "hello_world.wav": "hello world"}


def _load():
    spec = importlib.util.spec_from_file_location("from_vllm_openai_transcription_client", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server():
    proc, url = _start(DEMO, "--served-model-name", "demo-whisper")
    yield url
    assert _stop(proc) == 0


@pytest.fixture(scope="module")
def offline():
    llm = LLM(model=str(DEMO), dtype="float32", device="cpu")

    def transcribe(name: str, **sampling) -> str:
        return llm.transcribe(str(DEMO / name), language="en", temperature=0.0, use_tqdm=False, **sampling)[0].text

    return transcribe


def test_vllms_transcription_client_runs_with_only_the_server_changed(server, offline, capsys):
    plain, streamed = _load().main(["--base-url", f"{server}/v1"])  # no --model: read from /v1/models
    assert plain == offline("three_one_four.wav", seed=4419, repetition_penalty=1.3)
    assert streamed == offline("hello_world.wav", seed=420, top_p=0.6)
    assert streamed == EXPECTED["hello_world.wav"]  # the demo's own text: the oracle above is not empty
    out = capsys.readouterr().out
    assert "Using the model /v1/models lists: demo-whisper" in out and f"transcription result: {plain}" in out


def test_the_openai_clients_own_stream_reading_still_works(server, offline):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="EMPTY", timeout=TIMEOUT, max_retries=0)
    deltas, done = [], []
    with open(DEMO / "three_one_four.wav", "rb") as f:
        for event in client.audio.transcriptions.create(file=f, model="demo-whisper", language="en",
                                                        temperature=0.0, stream=True):
            if event.type == "transcript.text.delta":
                deltas.append(event.delta)
            elif event.type == "transcript.text.done":
                done.append(event.text)
    expected = offline("three_one_four.wav")
    assert expected == EXPECTED["three_one_four.wav"]
    assert done == [expected] and "".join(deltas) == expected
