"""``LLM.transcribe`` and the audio endpoints' driver: the same for every speech model.

The model class says how to transcribe (``tandem.core.transcription``): how raw
audio becomes a waveform, what each window's request is and how its output
moves the input on. This driver only runs the loop: it loads each input through
the model, submits one window per input, collects each finished window and
asks the model's session for the next, until every input is done. Windows of
different inputs run concurrently in the engine, one window per input in
flight. An input that fails (bad audio, a rejected window) gets a
:class:`Transcription` with ``error`` and the others go on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tandem.core.model_call import call_model
from tandem.core.transcription import (
    Transcription,
    TranscriptionContext,
    TranscriptionOptions,
    TranscriptionSession,
    check_transcription,
)

__all__ = ["Transcription", "prompt_ids_of", "subtitles", "transcribe", "transcribe_async"]


def prompt_ids_of(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids as OpenAI's ``prompt`` and faster-whisper's
    ``initial_prompt`` become: the stripped text after a space, no special tokens."""
    if not isinstance(text, str):
        raise TypeError(f"a text prompt (initial_prompt, prompt) must be a str, got {type(text).__name__}: {text!r}")
    if tokenizer is None:
        raise ValueError("a text prompt (initial_prompt, prompt): the model has no tokenizer to encode it; give "
                         "prompt_ids instead")
    return tokenizer(" " + text.strip(), add_special_tokens=False)["input_ids"]


def _session(engine, options: dict[str, Any], run_on_model: Any = None) -> TranscriptionSession:
    """The model's session for one call; ``engine`` is the ``LLMEngine``; ``run_on_model``:
    see :class:`TranscriptionContext`."""
    check_transcription(engine.model_cls, engine.architecture)
    initial_prompt = options.pop("initial_prompt", None)
    if initial_prompt is not None:
        if options.get("prompt_ids") is not None:
            raise ValueError("initial_prompt and prompt_ids are both given: they are the same prompt (as text and as "
                             "token ids); give one")
        options["prompt_ids"] = prompt_ids_of(engine.tokenizer, initial_prompt)
    known = {f for f in TranscriptionOptions.__dataclass_fields__ if f != "sampling"}
    given = {k: options.pop(k) for k in list(options) if k in known}
    if given.get("prompt_ids") is not None:
        given["prompt_ids"] = tuple(given["prompt_ids"])
    else:
        given.pop("prompt_ids", None)
    opts = TranscriptionOptions(**given, sampling=options)
    return engine.model_cls.transcription_session(TranscriptionContext.from_engine(engine, run_on_model), opts)


def transcribe(
    llm,  # a tandem.LLM (llm.py imports this module)
    audio: Any,
    *,
    sampling_rate: int | None = None,
    use_tqdm: bool = True,
    **options: Any,
) -> list[Transcription]:
    """See :meth:`tandem.LLM.transcribe` (``options``: :class:`TranscriptionOptions`'
    fields, other keywords are SamplingParams fields)."""
    engine = llm.llm_engine
    model_cls = engine.model_cls
    # This thread owns the engine: the model may run between steps.
    session = _session(engine, dict(options), run_on_model=lambda fn: call_model(fn, engine.model))
    items = audio if isinstance(audio, list) else [audio]
    results: list[Transcription | None] = [None] * len(items)
    states: dict[int, Any] = {}
    for i, item in enumerate(items):
        try:
            states[i] = session.start(model_cls.load_transcription_audio(*_source(item, sampling_rate)))
        except (ValueError, TypeError) as e:
            results[i] = Transcription(error=str(e))

    with llm.session() as requests:
        bar = _bar(len(states), use_tqdm)
        in_flight: dict[str, int] = {}

        def finish(i: int, result: Transcription) -> None:
            results[i] = result
            bar.update(1)

        def submit(i: int) -> None:
            try:
                w = session.next_window(states[i])
                in_flight[requests.add_request(w.prompt, w.params, prompt_slot=w.prompt_slot)] = i
            except (ValueError, TypeError) as e:
                finish(i, Transcription(error=str(e)))

        try:
            for i in states:
                submit(i)
            while requests.has_unfinished_requests():
                for out in requests.step():
                    i = in_flight.pop(out.request_id, None)
                    if i is None or not out.finished:
                        continue
                    if out.error is not None:
                        finish(i, Transcription(error=out.error))
                        continue
                    try:
                        done = session.take(states[i], out).done
                        if done:
                            finish(i, session.result(states[i]))
                    except (ValueError, TypeError) as e:
                        finish(i, Transcription(error=str(e)))
                        continue
                    if not done:
                        submit(i)
        finally:
            bar.close()
    return results  # type: ignore[return-value]


async def transcribe_async(engine, waveform, request_id: str, **options: Any):
    """One input (a waveform from the model's ``load_transcription_audio``) through an
    ``AsyncLLM``, window by window (requests ``{request_id}-w0``, ``-w1``...): yields each
    window's new segments as it finishes (when the model reports any), then the final
    :class:`Transcription`."""
    # The engine thread runs model calls between steps; ``take`` waits for them on a
    # worker thread (as its other CPU work), never on the event loop.
    session = _session(engine.engine, dict(options), run_on_model=lambda fn: engine.call_on_model(fn).result())
    state = session.start(waveform)
    n = 0
    while True:
        w = session.next_window(state)
        last = None
        async for out in engine.generate(w.prompt, w.params, f"{request_id}-w{n}", prompt_slot=w.prompt_slot):
            last = out
        n += 1
        if last.error is not None:
            raise ValueError(last.error)
        outcome = await asyncio.to_thread(session.take, state, last)
        if outcome.segments:
            yield outcome.segments
        if outcome.done:
            yield session.result(state)
            return


def _source(item: Any, sampling_rate: int | None) -> tuple[Any, int | None]:
    if isinstance(item, dict):
        unknown = set(item) - {"audio", "sampling_rate"}
        if "audio" not in item or unknown:
            raise ValueError(f"an audio input dict has 'audio' and 'sampling_rate', got keys {sorted(item)}")
        return item["audio"], item.get("sampling_rate", sampling_rate)
    if isinstance(item, (str, Path)):
        return item, None
    return item, sampling_rate


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Transcribing", disable=not enabled, unit="input")


def subtitles(segments: list[dict], fmt: str) -> str:
    """SRT or WebVTT cues from transcript segments."""

    def stamp(seconds: float) -> str:
        ms = max(0, round(seconds * 1000))
        h, ms = divmod(ms, 3_600_000)
        m, ms = divmod(ms, 60_000)
        s, ms = divmod(ms, 1000)
        sep = "," if fmt == "srt" else "."
        return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"

    cues = []
    for i, seg in enumerate(segments, 1):
        timing = f"{stamp(seg['start'])} --> {stamp(seg['end'])}"
        cues.append(f"{i}\n{timing}\n{seg['text']}\n" if fmt == "srt" else f"{timing}\n{seg['text']}\n")
    return ("WEBVTT\n\n" if fmt == "vtt" else "") + "\n".join(cues)
