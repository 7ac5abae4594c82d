"""The form fields ``/v1/audio/transcriptions`` and ``/translations`` take, and the
refusal of any other, as ``/v1/completions`` refuses a field it does not know.

- OpenAI's (its API reference for the two endpoints): ``file``, ``model``,
  ``language``, ``prompt``, ``response_format``, ``temperature``,
  ``timestamp_granularities[]``, ``stream``, ``chunking_strategy`` (``auto`` only:
  audio is decoded window by window anyway; VAD is ``vad_filter``) and ``include[]``
  (refused when given: it asks for ``logprobs``, which no transcript here carries);
- vLLM's (its ``TranscriptionRequest``): the sampling fields below, ``to_language``
  (a translation's is English, the only language Whisper translates into) and
  ``stream_include_usage`` / ``stream_continuous_usage_stats`` (read by
  :func:`stream_usage`; the stream's shapes: ``audio_stream.py``);
- tandem's: ``vad_filter``, ``vad_parameters`` (api_server.py reads them).

The sampling fields are vLLM's transcription sampling fields that ``SamplingParams``
has, each parsed from its form text by the type its metadata gives
(``tandem/entrypoints/sampling_options.py``); vLLM's ``max_completion_tokens`` sets
``max_tokens``.
"""

from __future__ import annotations

import math

from tandem.entrypoints.openai.protocol import HTTPError, validation_message
from tandem.entrypoints.sampling_options import api_fields

# vLLM's TranscriptionRequest sampling fields (temperature is OpenAI's, read on its own:
# a transcription session takes it as its first fallback temperature) -> the request name
# SamplingParams' metadata gives the field.
_VLLM_SAMPLING = {"top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                  "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                  "repetition_penalty": "repetition_penalty", "max_completion_tokens": "max_tokens"}
_API = api_fields()
# form name -> (SamplingParams field, the type its text is parsed as)
SAMPLING_FORM_FIELDS = {form: (_API[api].name, _API[api].metadata["api"])
                        for form, api in _VLLM_SAMPLING.items() if api in _API}

OWN_FIELDS = frozenset({
    "file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
    "timestamp_granularities", "stream", "chunking_strategy", "include[]", "include", "to_language",
    "stream_include_usage", "stream_continuous_usage_stats", "vad_filter", "vad_parameters",
})
KNOWN_FIELDS = OWN_FIELDS | set(SAMPLING_FORM_FIELDS)


def refuse_unknown(form) -> None:
    """A 400 naming the form's fields this endpoint does not take (as a completion's
    unknown fields are named: the first few, each cut, and a count of the rest)."""
    unknown = [(k, v) for k, v in form.multi_items() if k not in KNOWN_FIELDS]
    if unknown:
        errors = [{"type": "extra_forbidden", "loc": ("body", k), "msg": "Extra inputs are not permitted",
                   **({"input": v} if isinstance(v, str) else {})} for k, v in unknown]
        raise HTTPError(400, validation_message(errors), param=unknown[0][0][:200])


def sampling_options(form) -> dict:
    """The ``SamplingParams`` keywords of the form's sampling fields; ``ValueError`` naming
    a field whose text is not of its type."""
    out = {}
    for form_name, (name, kind) in SAMPLING_FORM_FIELDS.items():
        text = form.get(form_name)
        if text is None or text == "":
            continue
        out[name] = _parse(form_name, text, kind)
    return out


def _parse(name: str, text: str, kind):
    try:
        if kind is int:
            return int(text.strip())  # "1.5" and "true" are no int
        if kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except ValueError:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ValueError(f"{name}={shown!r}: must be {'an integer' if kind is int else 'a finite number'}") from None
    raise ValueError(f"{name}: a form field of type {kind} cannot be parsed")  # not reached for vLLM's fields


def check_other_fields(form, task: str) -> None:
    """OpenAI's and vLLM's fields this server takes only in the values it serves."""
    strategy = form.get("chunking_strategy")
    if strategy not in (None, "", "auto"):
        raise ValueError(f"chunking_strategy={strategy[:60]!r}: only 'auto' is served (audio is decoded window by "
                         "window); for voice-activity detection give vad_filter=true")
    include = form.getlist("include[]") + form.getlist("include")
    if include:
        raise ValueError(f"include[]={[x[:40] for x in include[:4]]!r}: not served (a transcript here carries no "
                         "logprobs)")
    to = form.get("to_language")
    if to not in (None, ""):
        if task == "translate" and to.lower() != "en":
            raise ValueError(f"to_language={to[:40]!r}: a translation here is into English (to_language=en)")
        if task == "transcribe":
            raise ValueError(f"to_language={to[:40]!r}: a transcription is in the audio's own language; use "
                             "/v1/audio/translations to translate into English")


def stream_usage(form, stream: bool) -> tuple[bool, bool]:
    """vLLM's flattened stream options: (usage in the done event, usage in every delta
    event). As vLLM: either true without ``stream=true`` is refused, and the continuous
    stats are sent only beside ``stream_include_usage=true`` (vLLM ignores them alone,
    and a client written for vLLM must get the same stream here)."""
    values = {}
    for name in ("stream_include_usage", "stream_continuous_usage_stats"):
        text = form.get(name) or "false"
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{name}={text[:40]!r}: must be true or false")
        values[name] = text.lower() == "true"
        if values[name] and not stream:
            raise ValueError(f"{name}=true: stream options need stream=true")
    include = values["stream_include_usage"]
    return include, include and values["stream_continuous_usage_stats"]
