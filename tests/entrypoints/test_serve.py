"""``tandem serve`` as a real process on 127.0.0.1, driven by the official openai
client and plain HTTP: completions (plain, streamed, n > 1, logprobs), errors,
auth, metrics, a bounded load test with disconnecting streams, and SIGTERM
draining. Every wait is bounded in count and time."""

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from helpers import SUBPROCESS_TIMEOUT
from tandem import LLM, SamplingParams

KEY = "test-key"
TIMEOUT = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir, *extra, log_path=None):
    """``tandem serve`` on 127.0.0.1 and a free port, once healthy: (process, url). Its
    output goes to a pipe, or to ``log_path`` (a test that must not block on a full pipe)."""
    port = _free_port()
    log = open(log_path, "w") if log_path is not None else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.entrypoints.cli", "serve", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--device", "cpu", *extra],
        stdout=log if log is not None else subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    if log is not None:
        log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = open(log_path).read() if log_path is not None else proc.stdout.read()
            raise RuntimeError(f"server exited: {output}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not become healthy in {SUBPROCESS_TIMEOUT:.0f} s")


def _stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=SUBPROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="module")
def server(bart_dir):
    proc, url = _start(bart_dir, "--api-key", KEY, "--served-model-name", "tiny-bart")
    yield url
    assert _stop(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def test_completion_equals_the_offline_engine(client, bart_dir):
    prompts = ["the rain in spain falls", "a cat sat on the mat"]
    res = client.completions.create(model="tiny-bart", prompt=prompts, max_tokens=10, temperature=0.0)
    ref = LLM(model=str(bart_dir), dtype="float32", device="cpu").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert [c.text for c in res.choices] == [r.outputs[0].text for r in ref]
    assert res.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)
    assert res.usage.prompt_tokens == sum(len(r.encoder_prompt_token_ids) + len(r.prompt_token_ids) for r in ref)
    assert res.model == "tiny-bart" and res.object == "text_completion"


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model="tiny-bart", prompt="red sun over the old river", max_tokens=12, temperature=0.0)
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason


def test_n_seed_token_prompts_and_logprobs(client):
    res = client.completions.create(model="tiny-bart", prompt=[0, 17, 5, 2], max_tokens=6, temperature=0.9, n=3,
                                    seed=7, logprobs=2)
    assert len(res.choices) == 3 and [c.index for c in res.choices] == [0, 1, 2]
    again = client.completions.create(model="tiny-bart", prompt=[0, 17, 5, 2], max_tokens=6, temperature=0.9, n=3,
                                      seed=7, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in res.choices]  # seeded
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
    assert all(v <= 0 for v in lp.token_logprobs)


def test_bad_requests_are_400s_naming_the_value(client):
    import openai

    cases = [
        (dict(prompt="the rain", temperature=-1.0), "temperature"),
        (dict(prompt=[0, 5000, 2]), "5000"),
        (dict(prompt="the rain", max_tokens=100000), "max_tokens"),
        (dict(prompt="the rain", top_p=0.0), "top_p"),
        (dict(prompt="the rain", extra_body={"not_a_field": 1}), "not_a_field"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny-bart", **kwargs)
        assert needle in str(info.value)
    with pytest.raises(openai.NotFoundError, match="serves 'tiny-bart'"):  # OpenAI's status for an unknown model
        client.completions.create(model="other", prompt="x")


def test_auth_body_limit_and_info_endpoints(server):
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).completions.create(model="tiny-bart", prompt="x")
    big = httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     content=json.dumps({"prompt": "a " * 3_000_000}), timeout=TIMEOUT)
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    models = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == "tiny-bart"
    assert httpx.get(f"{server}/version").json()["version"]
    metrics = httpx.get(f"{server}/metrics").text
    for name in ("tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc",
                 "tandem:prompt_tokens_total", "tandem:generation_tokens_total", "tandem:request_success_total",
                 "tandem:time_to_first_token_seconds", "tandem:inter_token_latency_seconds",
                 "tandem:e2e_request_latency_seconds", "tandem:num_preemptions_total"):
        assert name in metrics


def test_a_huge_prompt_is_a_400_naming_its_size_while_a_stream_goes_on(server):
    """A 3.6 MB prompt (under the 4 MiB body limit) is refused from a prefix of it, naming
    its characters and the limit; a stream beside it runs to its end. (Where the work runs
    is shown in-process: tests/entrypoints/test_engine_thread.py.)"""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny-bart", "prompt": "the rain in spain", "max_tokens": 100, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    huge = "the rain in spain falls mainly on plain " * 90_000
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        big = httpx.post(f"{server}/v1/completions", json={"prompt": huge, "max_tokens": 5}, headers=headers,
                         timeout=TIMEOUT)
        assert big.status_code == 400, big.text[:300]
        message = big.json()["error"]["message"]
        assert f"{len(huge)} characters" in message and "the model accepts at most 128" in message, message
        events = [first] + [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_load_with_disconnecting_streams_loses_nothing(server):
    """50 concurrent requests; every third streams and hangs up after two chunks."""
    headers = {"Authorization": f"Bearer {KEY}"}

    def one(i):
        body = {"model": "tiny-bart", "prompt": f"the rain {i} in spain", "max_tokens": 24, "temperature": 0.0,
                "ignore_eos": True}
        if i % 3 == 0:
            with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=headers,
                              timeout=TIMEOUT) as r:
                assert r.status_code == 200
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 2:
                        return "disconnected"  # leaving the block closes the connection
            return "stream ended early"
        r = httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return len(r.json()["choices"][0]["text"].split())

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(50)))
    assert results.count("disconnected") == 17
    assert all(isinstance(r, int) and r > 0 for i, r in enumerate(results) if i % 3)
    for _ in range(100):  # the aborted streams' blocks come back
        metrics = httpx.get(f"{server}/metrics").text
        if _metric(metrics, "tandem:kv_cache_usage_perc") == 0 and _metric(metrics, "tandem:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert _metric(metrics, "tandem:kv_cache_usage_perc") == 0
    assert _metric(metrics, "tandem:num_requests_running") == 0
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.slow
def test_sigterm_drains_running_requests_and_exits_zero(bart_dir):
    proc, url = _start(bart_dir)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, f"{url}/v1/completions",
                          json={"prompt": "the rain", "max_tokens": 120, "ignore_eos": True, "temperature": 0.0},
                          timeout=TIMEOUT)
        for _ in range(100):  # wait until the request is running
            if _metric(httpx.get(f"{url}/metrics").text, "tandem:num_requests_running") >= 1:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        res = fut.result(timeout=TIMEOUT)
    assert res.status_code == 200 and len(res.json()["choices"][0]["text"].split()) > 0
    assert proc.wait(timeout=TIMEOUT) == 0


@pytest.fixture(scope="module")
def whisper_server(tmp_path_factory):
    from helpers import make_whisper

    path = make_whisper(tmp_path_factory.mktemp("whisper_serve") / "ckpt", num_mel_bins=80, seed=3, timestamps=True)
    proc, url = _start(path, "--served-model-name", "tiny-whisper")
    yield path, url
    assert _stop(proc) == 0


def test_audio_transcriptions_equal_the_offline_engine(whisper_server, tmp_path):
    import soundfile as sf

    from helpers import synth_audio

    path, url = whisper_server
    clip = synth_audio(40.0, seed=5)  # long-form: two windows or more
    wav = tmp_path / "talk.wav"
    sf.write(wav, clip, 16000)
    offline = LLM(model=str(path), dtype="float32", device="cpu").transcribe(
        str(wav), language="de", timestamps=True, use_tqdm=False)[0]

    def post(**fields):
        with open(wav, "rb") as f:
            return httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("talk.wav", f, "audio/wav")},
                              data={"model": "tiny-whisper", "language": "de", **fields}, timeout=TIMEOUT)

    verbose = post(response_format="verbose_json")
    assert verbose.status_code == 200, verbose.text
    body = verbose.json()
    assert body["language"] == "de" and body["duration"] == pytest.approx(40.0)
    assert [s["tokens"] for s in body["segments"]] == [s["token_ids"] for s in offline.segments]
    assert [s["start"] for s in body["segments"]] == [s["start"] for s in offline.segments]
    srt = post(response_format="srt")
    assert srt.status_code == 200 and srt.text.startswith("1\n00:00:")
    assert post().json() == {"text": offline.text}
    streamed = post(stream="true")
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["type"] == "transcript.text.done"
    deltas = [seg for e in events if e["type"] == "transcript.text.delta" for seg in e["segments"]]
    assert [s["token_ids"] for s in deltas] == [s["token_ids"] for s in offline.segments]
    assert streamed.text.rstrip().endswith("data: [DONE]")
    # Translations use the translate task; bad input is a 400 naming it.
    with open(wav, "rb") as f:
        tr = httpx.post(f"{url}/v1/audio/translations", files={"file": ("talk.wav", f)}, timeout=TIMEOUT)
    assert tr.status_code == 200
    bad = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("x.wav", b"not audio")}, timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    fmt = post(response_format="mp4")
    assert fmt.status_code == 400 and "response_format" in fmt.json()["error"]["message"]
    words = post(**{"timestamp_granularities[]": "word"})
    assert words.status_code == 400 and "word" in words.json()["error"]["message"]
