"""The audio a client's completion prompt carries: bytes, never a path on the server.

A prompt's audio (``{"audio": A}``, alone or as the ``encoder_prompt``) is, on
the server, one of

- ``{"data": "<base64 of an audio file>", "format": "wav"}`` (OpenAI's
  ``input_audio`` object; ``format`` is optional and only informative: the
  container is read from the bytes);
- ``"data:audio/wav;base64,<base64>"``, a data URL (vLLM's ``audio_url`` form);
- a path, only when the operator gave ``--allowed-local-media-path DIR`` and
  only inside DIR (relative paths are taken from DIR; symlinks and ``..`` are
  resolved first). Any other string is refused with one message that depends on
  nothing but the field, so an answer never tells whether a file exists, and no
  file is opened or looked at to say so.

Where the check lives: the server walks every dict of every prompt, at any
depth, and every ``"audio"`` it finds is replaced here by the decoded waveform
(a tensor, at the model's sample rate) before the request reaches the engine;
the engine reads audio only from such dicts. The offline API (``LLM``,
``AsyncLLM`` used directly), the CLI and Ray jobs never pass through here:
their callers own the disk, and paths stay theirs.

Bounds, as for uploads: inline data is inside the JSON body (``--max-body-bytes``);
each decode is held to the model's window (a completion prompt is one window;
longer audio goes to ``/v1/audio/transcriptions``) and to what is left of
``--max-audio-seconds`` for the whole request, checked from the file's header
before anything is decoded and again while decoding.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
from typing import Any

from tandem.core.transcription import AudioTooLongError, supports_transcription
from tandem.entrypoints.openai.protocol import HTTPError

# A data URL's head: "data:" [media type and parameters] ";base64", then ",".
_DATA_URL = re.compile(r"data:([^,;]*(?:;[^,;=]+=[^,;]*)*);base64,", re.IGNORECASE)
_INLINE_KEYS = {"data", "format"}
_MAX_FORMAT_CHARS = 32


def find_audio(prompts: list[Any]) -> list[tuple[dict, str]]:
    """Every dict in ``prompts`` (at any depth of dicts) that has an ``"audio"`` key,
    with where it is (``prompt[1].encoder_prompt``). Lists inside prompts (token ids)
    are not walked: nothing reads audio from a list."""
    spots = []
    stack = [(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        if "audio" in node:
            spots.append((node, where))
        stack.extend((v, f"{where}.{k}") for k, v in node.items() if isinstance(v, dict))
    spots.reverse()  # in the order the client wrote them, for the seconds budget
    return spots


class PromptAudio:
    """Reads prompt audio for one server: ``load`` (CPU and file work: call it off the
    event loop) decodes every audio value of a request's prompts in place, or raises
    :class:`HTTPError` (400; 413 over ``--max-audio-seconds``)."""

    def __init__(self, model_cls: type, hf_config: Any, architecture: str, *, max_seconds: float | None,
                 allowed_dir: str | os.PathLike | None = None) -> None:
        self.model_cls, self.hf_config, self.architecture = model_cls, hf_config, architecture
        self.is_audio = supports_transcription(model_cls)
        self.max_seconds = max_seconds
        self.allowed_dir = allowed_local_dir(allowed_dir) if allowed_dir is not None else None

    def refusal(self, where: str) -> HTTPError:
        """The one answer to a string that is not inline data: the same for every path
        (existing, missing, unreadable, outside the allowed directory)."""
        local = (", name a file inside the directory this server's operator allowed (--allowed-local-media-path)"
                 if self.allowed_dir is not None else "")
        return HTTPError(400, f"{where}.audio: this server reads no file a client names: send the audio's bytes "
                              "inline ({\"data\": \"<base64 of the file>\"} or a \"data:audio/...;base64,...\" "
                              f"URL){local}, or upload it to /v1/audio/transcriptions", param=f"{where}.audio")

    def load(self, prompts: list[Any]) -> None:
        spots = find_audio(prompts)
        if not spots:
            return
        if not self.is_audio:
            where = spots[0][1]
            raise HTTPError(400, f"{where}.audio: {self.architecture} takes no audio", param=f"{where}.audio")
        sources = [self._source(node["audio"], where) for node, where in spots]  # refusals before any decode
        window = float(self.model_cls.transcription_window_seconds(self.hf_config))
        rate = self.model_cls.transcription_sample_rate
        left = math.inf if self.max_seconds is None else float(self.max_seconds)
        for (node, where), source in zip(spots, sources):
            if left <= 0:
                raise self._over_budget(where, "no audio seconds are left")
            limit = min(window, left)
            try:
                waveform = self.model_cls.load_transcription_audio(source, node.get("sampling_rate"),
                                                                   max_seconds=limit)
            except AudioTooLongError as e:
                if limit < window:
                    raise self._over_budget(where, str(e)) from None
                raise HTTPError(400, f"{where}.audio: {e}: a completion prompt holds one {window:g}-second window "
                                     "of audio; send longer audio to /v1/audio/transcriptions",
                                param=f"{where}.audio") from None
            except (ValueError, TypeError) as e:
                raise HTTPError(400, f"{where}.audio: {e}", param=f"{where}.audio") from None
            left -= waveform.numel() / rate
            node["audio"], node["sampling_rate"] = waveform, rate

    def _over_budget(self, where: str, why: str) -> HTTPError:
        return HTTPError(413, f"{where}.audio: {why}: this server takes at most {self.max_seconds:g} s of audio "
                              "per request, all prompts together (--max-audio-seconds)", param=f"{where}.audio")

    def _source(self, value: Any, where: str) -> bytes | str:
        """The bytes of inline audio, or the real path of an allowed local file."""
        field = f"{where}.audio"
        if isinstance(value, dict):
            unknown = set(value) - _INLINE_KEYS
            if unknown:
                names = ", ".join(repr(k[:40]) for k in sorted(unknown)[:8])
                raise HTTPError(400, f"{field}: unknown keys [{names}] in inline audio (it has 'data' and an "
                                     "optional 'format')", param=field)
            fmt = value.get("format")
            if fmt is not None and not (isinstance(fmt, str) and 0 < len(fmt) <= _MAX_FORMAT_CHARS):
                raise HTTPError(400, f"{field}.format must be a short string such as \"wav\" or \"flac\"",
                                param=f"{field}.format")
            return _base64(value.get("data"), f"{field}.data")
        if isinstance(value, str):
            head = _DATA_URL.match(value[:256])
            if head is not None:
                return _base64(value[head.end():], field)
            if value[:5].lower() == "data:":
                raise HTTPError(400, f"{field}: a data URL must be base64: \"data:audio/wav;base64,<base64>\"",
                                param=field)
            return self._local(value, where)
        raise HTTPError(400, f"{field} must be inline audio, {{\"data\": \"<base64 of the file>\"}} or a "
                             f"\"data:audio/...;base64,...\" URL, got {type(value).__name__}", param=field)

    def _local(self, text: str, where: str) -> str:
        """An allowed file's real path; anything else is the same refusal. Nothing on
        disk is looked at unless the path lies inside the allowed directory as written."""
        root = self.allowed_dir
        if root is None or not text or "\0" in text:
            raise self.refusal(where)
        try:
            lexical = os.path.normpath(os.path.join(root, text))  # an absolute path stays itself
            if not _inside(lexical, root):
                raise self.refusal(where)
            real = os.path.realpath(lexical)  # symlinks resolved: one may point out of the directory
        except (OSError, ValueError):
            raise self.refusal(where) from None
        if not _inside(real, root):
            raise self.refusal(where)
        return real


def allowed_local_dir(path: str | os.PathLike) -> str:
    """``--allowed-local-media-path``: the directory's real path; ``ValueError`` naming it
    when it is not a directory."""
    real = os.path.realpath(os.fspath(path))
    if not os.path.isdir(real):
        raise ValueError(f"--allowed-local-media-path {os.fspath(path)!r} is not a directory")
    return real


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _base64(data: Any, field: str) -> bytes:
    if not isinstance(data, str):
        raise HTTPError(400, f"{field} must be a base64 string (the audio file's bytes), got {type(data).__name__}",
                        param=field)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise HTTPError(400, f"{field} is not valid base64 ({e})", param=field) from None
    if not raw:
        raise HTTPError(400, f"{field} is empty: it must hold an audio file's bytes", param=field)
    return raw
