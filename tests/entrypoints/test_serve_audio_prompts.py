"""Audio in a completion prompt on ``tandem serve`` is bytes, never a client's path
(issue 37, failures 1 and 2; ``tandem/entrypoints/openai/media.py``).

- a path in a client's prompt (``{"audio": path}``, ``{"encoder_prompt":
  {"audio": path}}``, streamed or not, in a list of prompts) is a 400 whose body
  is the same whether the file exists, is not audio, is unreadable, is a
  directory or is missing; nothing is opened or even looked at to say so;
- inline audio (``{"data": base64}`` or a ``data:`` URL) is served, and equals
  what the offline API gives for the same file's path (paths stay allowed there);
- ``--allowed-local-media-path DIR`` allows files inside DIR only: ``..`` and
  symlinks out of it get the same opaque 400, and the file outside is not opened;
- every route applies the bounds from the file's header before decoding: an
  hour of FLAC is refused with no block decoded (the model's 30 s window, or
  ``--max-audio-seconds`` for the request's prompts together: 413).

The probe's cases run through a real server on 127.0.0.1 (the shipped demo
Whisper, default flags); what needs a look inside the process (no file touched,
no block decoded) runs in-process through ``httpx.ASGITransport``.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import io
import os
import shutil

import httpx
import numpy as np
import pytest
import soundfile as sf

from tandem import LLM, AsyncLLM, SamplingParams
from tandem.demo_whisper import PATH as DEMO
from tandem.entrypoints.openai.api_server import build_app
from helpers import count_audio_reads
from test_serve import _start, _stop
from test_serve_hostile import _error, _flac

WAIT = 60.0  # a tiny model on 2 busy cores answers in well under a second; generous
HELLO = DEMO / "hello_world.wav"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _wav_bytes(seconds: float) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(seconds * 16000), np.int16), 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """The server's disk as a hostile client probes it: a real WAV, a text file (as
    /etc/hostname), an unreadable WAV, a directory, a missing path."""
    root = tmp_path_factory.mktemp("server_disk")
    shutil.copy(HELLO, root / "x.wav")
    (root / "hostname").write_text("box\n")
    shutil.copy(HELLO, root / "locked.wav")
    os.chmod(root / "locked.wav", 0)
    (root / "folder").mkdir()
    paths = {"audio": root / "x.wav", "text": root / "hostname", "unreadable": root / "locked.wav",
             "directory": root / "folder", "missing": root / "missing.wav"}
    return root, {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def server():
    proc, url = _start(DEMO, "--served-model-name", "w")
    yield url
    assert _stop(proc) == 0


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM(model=str(DEMO), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


@pytest.fixture(scope="module")
def offline():
    return LLM(model=str(DEMO), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def offline_text(offline):
    """What the offline API makes of the file's path: the oracle for inline audio."""
    out = offline.generate({"audio": str(HELLO)}, SamplingParams(temperature=0), use_tqdm=False)[0]
    assert out.error is None and "hello world" in out.outputs[0].text
    return out.outputs[0].text


FORMS = {
    "prompt": lambda a: {"audio": a},
    "encoder_prompt": lambda a: {"encoder_prompt": {"audio": a}},
    "with a decoder prompt": lambda a: {"encoder_prompt": {"audio": a, "sampling_rate": 16000},
                                        "decoder_prompt": {"prompt_token_ids": [384]}},
}


def _refusals(post, paths: dict[str, str], body: dict) -> None:
    """Every path, in every prompt form, gets one and the same 400 (per form), which
    names the field and nothing of the disk."""
    for form, make in FORMS.items():
        answers = {name: post({**body, "prompt": make(p)}) for name, p in paths.items()}
        first = answers["missing"]
        message = _error(first, 400)
        assert ".audio: this server reads no file a client names" in message, message
        for name, r in answers.items():
            assert r.status_code == 400 and r.content == first.content, (form, name, r.text, first.text)
        for leak in ("no such file", "not a file", "unreadable", "Format", "ermission", "hostname", "server_disk"):
            assert leak not in first.text, (leak, first.text)


# ------------------------------------------------------------------ a real server, the probe's cases


def test_a_path_in_a_prompt_is_refused_alike_whatever_is_on_disk(server, disk):
    root, paths = disk

    def post(body):
        return httpx.post(f"{server}/v1/completions", json=body, timeout=WAIT)

    _refusals(post, paths, {"temperature": 0})
    _refusals(post, paths, {"temperature": 0, "stream": True})
    # Among other prompts, or beside inline audio: the request is refused whole.
    inline = {"audio": {"data": _b64(HELLO.read_bytes())}}
    for prompt in ([inline, {"audio": paths["audio"]}], [{"prompt_token_ids": [1]}, {"audio": paths["audio"]}]):
        r = post({"prompt": prompt, "temperature": 0})
        assert "prompt[1].audio: this server reads no file" in _error(r, 400)
    # Nested anywhere in a prompt's dicts: refused there too, before the engine sees it.
    r = post({"prompt": {"encoder_prompt": {"encoder_prompt": {"audio": paths["audio"]}}}})
    assert "prompt.encoder_prompt.encoder_prompt.audio: this server reads no file" in _error(r, 400)


def test_inline_audio_is_served_as_the_offline_api_serves_the_path(server, offline_text):
    data = HELLO.read_bytes()
    for audio in ({"data": _b64(data), "format": "wav"}, {"data": _b64(data)}, "data:audio/wav;base64," + _b64(data),
                  "DATA:;base64," + _b64(data)):
        for form in ("prompt", "encoder_prompt"):
            r = httpx.post(f"{server}/v1/completions", json={"prompt": FORMS[form](audio), "temperature": 0},
                           timeout=WAIT)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == offline_text
    for audio, why in (({"data": "not base64!"}, "prompt.audio.data is not valid base64"),
                       ({"data": ""}, "prompt.audio.data is empty"),
                       ({"data": _b64(data), "path": "/x"}, "unknown keys ['path'] in inline audio"),
                       ("data:audio/wav," + "RIFF", "a data URL must be base64"),
                       (17, "prompt.audio must be inline audio"),
                       ({"data": _b64(b"not audio at all")},
                        "prompt.audio: unreadable audio file <16 bytes of audio>")):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": {"audio": audio}}, timeout=WAIT)
        assert why in _error(r, 400)


def test_an_hour_of_inline_flac_is_refused_from_its_header(server):
    """Failure 2: the probe's hour-long FLAC was decoded whole before the 400. The
    header says 3600 s: refused before a block is decoded (the message is the header
    check's; the decode-time one says "decoding stopped at")."""
    r = httpx.post(f"{server}/v1/completions", json={"prompt": {"audio": {"data": _b64(_flac(3600))}}},
                   timeout=WAIT)
    message = _error(r, 400)
    assert "declares 3600.0 s, over the 30-second limit" in message
    assert "one 30-second window" in message and "/v1/audio/transcriptions" in message
    # A header that does not say how long: decoding stops at the window, not the hour.
    r = httpx.post(f"{server}/v1/completions",
                   json={"prompt": {"audio": {"data": _b64(_flac(3600, unknown_length=True))}}}, timeout=WAIT)
    assert "decoding stopped at 30.0 s" in _error(r, 400)


# ------------------------------------------------------------------ in-process: what the server touches


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT)


def _watch_disk(monkeypatch, needle: str, *, stats: bool) -> list:
    """Records each open (and, with ``stats``, each stat) of a path containing ``needle``."""
    seen: list = []

    def recording(name, fn):
        def wrapper(path, *args, **kwargs):
            if needle in str(path if not isinstance(path, bytes) else path.decode(errors="replace")):
                seen.append((name, str(path)))
            return fn(path, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(builtins, "open", recording("open", builtins.open))
    monkeypatch.setattr(io, "open", recording("io.open", io.open))
    monkeypatch.setattr(os, "open", recording("os.open", os.open))
    monkeypatch.setattr(sf, "SoundFile", recording("SoundFile", sf.SoundFile))
    if stats:
        monkeypatch.setattr(os, "stat", recording("stat", os.stat))
        monkeypatch.setattr(os, "lstat", recording("lstat", os.lstat))
    return seen


@pytest.mark.asyncio
async def test_no_file_is_opened_or_looked_at_for_a_clients_path(engine, disk, monkeypatch):
    root, paths = disk
    app = build_app(engine, served_model_name="w")
    seen = _watch_disk(monkeypatch, str(root), stats=True)
    async with _client(app) as c:
        answers = [await c.post("/v1/completions", json={"prompt": FORMS["prompt"](p)}) for p in paths.values()]
    assert {r.status_code for r in answers} == {400} and len({r.content for r in answers}) == 1
    assert seen == []


@pytest.mark.asyncio
async def test_allowed_local_media_path_allows_its_directory_only(engine, tmp_path, offline_text, monkeypatch):
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    shutil.copy(HELLO, allowed / "in.wav")
    shutil.copy(HELLO, outside / "x.wav")
    (allowed / "link.wav").symlink_to(outside / "x.wav")  # inside by name, outside in fact
    (allowed / "hour.flac").write_bytes(_flac(3600))
    app = build_app(engine, served_model_name="w", allowed_local_media_path=str(allowed))
    reads = count_audio_reads(monkeypatch)
    opened = _watch_disk(monkeypatch, str(outside), stats=False)
    async with _client(app) as c:
        async def post(prompt, **fields):
            return await c.post("/v1/completions", json={"prompt": prompt, "temperature": 0, **fields})

        for path in (str(allowed / "in.wav"), "in.wav", str(allowed / "sub" / ".." / "in.wav")):
            r = await post({"audio": path})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline_text, (path, r.text)
        assert reads and opened == []  # served: decoded, and nothing outside opened
        escapes = (str(outside / "x.wav"), str(allowed / ".." / "secret" / "x.wav"), "../secret/x.wav",
                   str(allowed / "link.wav"), str(outside / "missing.wav"), "/etc/hostname", "")
        refused = [await post({"audio": p}) for p in escapes]
        message = _error(refused[0], 400)
        assert "name a file inside the directory this server's operator allowed (--allowed-local-media-path)" in message
        assert all(r.content == refused[0].content for r in refused), [r.text for r in refused]
        assert "secret" not in message and str(tmp_path) not in message
        # Inside the directory the operator allowed it, so its errors may say what is there.
        assert "no such file" in _error(await post({"audio": "nope.wav"}), 400)
        # The header bounds a local file as it bounds bytes: no block of the hour decoded.
        reads.clear()
        assert "declares 3600.0 s" in _error(await post({"audio": "hour.flac"}), 400)
        assert reads == []
    assert opened == []


@pytest.mark.asyncio
async def test_max_audio_seconds_bounds_a_requests_prompt_audio_from_the_header(engine, monkeypatch):
    app = build_app(engine, served_model_name="w", max_audio_seconds=20)
    reads = count_audio_reads(monkeypatch)
    async with _client(app) as c:
        async def post(prompt):
            return await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})

        for data in (_flac(3600), _wav_bytes(25)):
            message = _error(await post({"audio": {"data": _b64(data)}}), 413)
            assert "over the 20-second limit" in message and "(--max-audio-seconds)" in message
            assert "declares" in message
        assert reads == []  # refused from the header, nothing decoded
        # All prompts together: two 8 s clips fit in 20 s, a third is over.
        clip = {"audio": {"data": _b64(_wav_bytes(8))}}
        assert (await post([clip, clip])).status_code == 200
        message = _error(await post([clip, clip, clip]), 413)
        assert message.startswith("prompt[2].audio:") and "all prompts together (--max-audio-seconds)" in message


@pytest.mark.asyncio
async def test_the_offline_api_still_takes_paths(engine, disk, offline_text):
    """Paths stay for callers who own the disk: AsyncLLM used directly (and LLM, the
    oracle above) read the file they name."""
    root, paths = disk
    out = None
    async for out in engine.generate({"encoder_prompt": {"audio": paths["audio"]}}, SamplingParams(temperature=0),
                                     "offline-path"):
        pass
    assert out.error is None and out.outputs[0].text == offline_text
    with pytest.raises(ValueError, match="no such file: .*missing.wav"):  # its caller's own disk: said plainly
        async for out in engine.generate({"audio": paths["missing"]}, SamplingParams(temperature=0), "offline-miss"):
            pass


def test_offline_an_hour_long_file_is_refused_from_its_header(offline, tmp_path, monkeypatch):
    """``generate`` takes one 30 s window: a longer file is refused before it is decoded
    (``transcribe`` takes any length, window by window)."""
    hour = tmp_path / "hour.flac"
    hour.write_bytes(_flac(3600))
    reads = count_audio_reads(monkeypatch)
    out = offline.generate({"audio": str(hour)}, SamplingParams(temperature=0), use_tqdm=False)[0]
    assert "declares 3600.0 s" in out.error and "30 s window; use LLM.transcribe" in out.error
    assert reads == []
