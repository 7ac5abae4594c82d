"""examples/from_vllm/openai_transcription_client.py and openai_translation_client.py (vLLM's
online Whisper clients, the import and the server changed) against a real ``tandem serve`` of
the shipped demo Whisper on 127.0.0.1, served under vLLM's model name: both read every
stream to the end (the ``openai`` client's chunks, plain HTTP read line by line as vLLM's
clients do) and the ``openai`` client's own typed stream events still work. Every text is
checked against offline ``LLM.transcribe`` on the same audio with the same fields."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tandem import LLM
from tandem.assets.audio import AudioAsset
from tandem.demo_whisper import PATH as DEMO

pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # a served engine in a subprocess: about a minute on 2 busy cores
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from test_serve import TIMEOUT, _start, _stop  # noqa: E402 - the served-process helpers of the serve tests

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "from_vllm"
NAME = "openai/whisper-large-v3"  # vLLM's clients' model


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"from_vllm_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def no_recordings(tmp_path_factory):
    """An empty assets folder: the clients' AudioAssets are the demo's stand-ins."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_ASSETS_CACHE", str(tmp_path_factory.mktemp("assets")))
        yield


@pytest.fixture(scope="module")
def server():
    proc, url = _start(DEMO, "--served-model-name", NAME)
    yield url
    assert _stop(proc) == 0


@pytest.fixture(scope="module")
def offline():
    llm = LLM(model=str(DEMO), dtype="float32", device="cpu")

    def run(path, **fields) -> str:
        return llm.transcribe(str(path), language="en", temperature=0.0, use_tqdm=False, **fields)[0].text

    return run


def test_vllms_transcription_client_reads_both_streams_to_the_end(server, offline, capsys):
    example = _load("openai_transcription_client")
    plain, streamed = example.main(example.parse_args(["--base-url", f"{server}/v1"]))
    # AudioAsset("mary_had_lamb") / ("winning_call"): the demo's clips
    assert plain == offline(DEMO / "three_one_four.wav", seed=4419, repetition_penalty=1.3)
    assert streamed == offline(DEMO / "hello_world.wav", seed=420, top_p=0.6) == "hello world"
    assert plain == "three one four one five nine"
    out = capsys.readouterr().out
    assert f"Using model: {NAME}" in out and f"transcription result [sync]: {plain}" in out


def test_the_transcription_clients_plain_http_stream(server, offline):
    pytest.importorskip("requests")
    example = _load("openai_transcription_client")
    streamed = example.stream_api_response(str(DEMO / "hello_world.wav"), NAME, f"{server}/v1")
    assert streamed == offline(DEMO / "hello_world.wav") == "hello world"


def test_vllms_translation_client_reads_every_event(server, offline, capsys):
    example = _load("openai_translation_client")
    plain, streamed = example.main(["--base-url", f"{server}/v1"])  # vLLM's language="it": not used
    foscolo = AudioAsset("azacinto_foscolo").get_local_path()  # the stand-in: "yes no stop go"
    assert plain == offline(foscolo, task="translate", seed=4419, repetition_penalty=1.3)
    assert streamed == offline(foscolo, task="translate") == plain == "yes no stop go"
    assert f"translation result: {plain}" in capsys.readouterr().out


def test_the_openai_clients_own_stream_reading_still_works(server, offline):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="EMPTY", timeout=TIMEOUT, max_retries=0)
    deltas, done = [], []
    with open(DEMO / "three_one_four.wav", "rb") as f:
        for event in client.audio.transcriptions.create(file=f, model=NAME, language="en", temperature=0.0,
                                                        stream=True):
            if event.type == "transcript.text.delta":
                deltas.append(event.delta)
            elif event.type == "transcript.text.done":
                done.append(event.text)
    expected = offline(DEMO / "three_one_four.wav")
    assert expected == "three one four one five nine"
    assert done == [expected] and "".join(deltas) == expected
