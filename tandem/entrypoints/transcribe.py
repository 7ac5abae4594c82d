"""``LLM.transcribe`` and the audio endpoints' driver: the same for every speech model.

The model class says how to transcribe (``tandem.core.transcription``): how raw
audio becomes a waveform, what each window's request is and how its output
moves the input on. This driver only runs the loop: it loads each input through
the model, submits one window per input, collects each finished window and
asks the model's session for the next, until every input is done. Windows of
different inputs run concurrently in the engine, one window per input in
flight. An input that fails (bad audio, a rejected window) gets a
:class:`Transcription` with ``error`` and the others go on.

With ``vad_filter`` each input is first cut into its speech chunks
(``vad_batched.py``): each chunk is an input of its own to the session, all of
them in flight at once, and their transcripts are merged back into the input's
time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.core.transcription import (
    Transcription,
    TranscriptionContext,
    TranscriptionOptions,
    TranscriptionSession,
    WindowOutcome,
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


def _vad_plan(engine, vad_filter: Any, vad_parameters: Any):
    """The call's :class:`~tandem.entrypoints.vad_batched.VadPlan` (None when off)."""
    from tandem.entrypoints.vad_batched import VadPlan

    cls = engine.model_cls
    return VadPlan.create(vad_filter, vad_parameters, cls.transcription_sample_rate,
                          cls.transcription_window_seconds(engine.hf_config))


def _detects_language(engine, options: dict[str, Any]) -> bool:
    """Whether the model will detect each input's language (none given, several possible)."""
    if options.get("language") is not None:
        return False
    return len(engine.model_cls.transcription_languages(TranscriptionContext.from_engine(engine))) > 1


@dataclass
class _Job:
    """One input: the waveforms its session inputs are (the whole input, or its speech
    chunks), their results, and the chunks that wait for the first one's language."""

    units: list[Any]
    chunks: list | None = None  # None: the whole input is one unit (no VAD)
    results: list[Transcription | None] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)


def transcribe(
    llm,  # a tandem.LLM (llm.py imports this module)
    audio: Any,
    *,
    sampling_rate: int | None = None,
    use_tqdm: bool = True,
    vad_filter: Any = False,
    vad_parameters: dict | None = None,
    lora_request: Any = None,
    **options: Any,
) -> list[Transcription]:
    """See :meth:`tandem.LLM.transcribe` (``options``: :class:`TranscriptionOptions`'
    fields, other keywords are SamplingParams fields)."""
    from tandem.lora.request import lora_list

    engine = llm.llm_engine
    model_cls = engine.model_cls

    run_on_model = engine.call_model  # this thread owns the engine: it runs between steps

    session = _session(engine, dict(options), run_on_model=run_on_model)
    vad = _vad_plan(engine, vad_filter, vad_parameters)
    detect = vad is not None and _detects_language(engine, options)
    by_language: dict[str | None, TranscriptionSession] = {}

    def session_for(language: str | None) -> TranscriptionSession:  # the chunks after a detected first one
        if language not in by_language:
            by_language[language] = _session(engine, {**options, "language": language}, run_on_model=run_on_model)
        return by_language[language]

    items = audio if isinstance(audio, list) else [audio]
    loras = lora_list(lora_request, len(items), "audio inputs")
    results: list[Transcription | None] = [None] * len(items)
    jobs: dict[int, _Job] = {}
    for i, item in enumerate(items):
        try:
            waveform = model_cls.load_transcription_audio(*_source(item, sampling_rate))
            if vad is None:
                jobs[i] = _Job([waveform])
            else:
                what = repr(str(item)) if isinstance(item, (str, Path)) else f"audio input {i}"
                chunks = vad.chunks(waveform, what)
                jobs[i] = _Job([c.waveform for c in chunks], chunks, [None] * len(chunks),
                               list(range(1, len(chunks))) if detect else [])
        except (ValueError, TypeError) as e:
            results[i] = Transcription(error=str(e))

    with llm.session() as requests:
        bar = _bar(len(jobs), use_tqdm)
        in_flight: dict[str, tuple[int, int]] = {}  # request id -> (input, unit)
        states: dict[tuple[int, int], tuple[TranscriptionSession, Any]] = {}

        def finish(i: int, result: Transcription) -> None:
            results[i] = result
            bar.update(1)
            stale = [rid for rid, (j, _) in in_flight.items() if j == i]  # a failed input's other chunks
            if stale:
                requests.abort_request(stale)
                for rid in stale:
                    del in_flight[rid]

        def unit_done(i: int, k: int, result: Transcription) -> None:
            states.pop((i, k), None)
            job = jobs[i]
            if results[i] is not None:  # the input already failed
                return
            if job.chunks is None:
                finish(i, result)
                return
            job.results[k] = result
            if result.error is None and job.waiting:  # the first chunk's language, for the others
                waiting, job.waiting = job.waiting, []
                for k2 in waiting:
                    start(i, k2, session_for(result.language))
            if result.error is not None or all(r is not None for r in job.results):
                finish(i, merged(job))

        def merged(job: _Job) -> Transcription:
            from tandem.entrypoints.vad_batched import merge

            return merge(job.chunks, [r for r in job.results if r is not None],
                         timestamps=bool(options.get("timestamps")),
                         word_timestamps=bool(options.get("word_timestamps")), language=options.get("language"))

        def start(i: int, k: int, s: TranscriptionSession) -> None:
            try:
                states[(i, k)] = (s, s.start(jobs[i].units[k]))
            except (ValueError, TypeError) as e:
                unit_done(i, k, Transcription(error=str(e)))
                return
            submit(i, k)

        def submit(i: int, k: int) -> None:
            s, state = states[(i, k)]
            try:
                w = s.next_window(state)
                rid = requests.add_request(w.prompt, w.params, prompt_slot=w.prompt_slot, lora_request=loras[i])
                in_flight[rid] = (i, k)
            except (ValueError, TypeError) as e:
                unit_done(i, k, Transcription(error=str(e)))

        try:
            for i, job in jobs.items():
                if job.chunks == []:  # no speech found: nothing to decode
                    finish(i, merged(job))
                for k in range(len(job.units)):
                    if k not in job.waiting:
                        start(i, k, session)
            while requests.has_unfinished_requests():
                for out in requests.step():
                    if not out.finished:
                        continue
                    key = in_flight.pop(out.request_id, None)
                    if key is None:
                        continue
                    s, state = states[key]
                    if out.error is not None:
                        unit_done(*key, Transcription(error=out.error))
                        continue
                    try:
                        done = s.take(state, out).done
                        if done:
                            unit_done(*key, s.result(state))
                            continue
                    except (ValueError, TypeError) as e:
                        unit_done(*key, Transcription(error=str(e)))
                        continue
                    submit(*key)
        finally:
            bar.close()
    return results  # type: ignore[return-value]


async def transcribe_async(engine, waveform, request_id: str, *, vad_filter: Any = False,
                           vad_parameters: dict | None = None, lora_request: Any = None, **options: Any):
    """One input (a waveform from the model's ``load_transcription_audio``) through an
    ``AsyncLLM``, window by window (requests ``{request_id}-w0``, ``-w1``...): yields a
    :class:`WindowOutcome` as each window finishes (its new segments and, when the model
    says, the text so far; one whose window added neither is not yielded), then the
    final :class:`Transcription`. With ``vad_filter``: the speech chunks' windows run
    concurrently (requests ``{request_id}-c{k}-w{n}``) and each chunk is yielded in
    order as one outcome (its segments, one spanning the chunk without timestamps, and
    the merged text so far)."""
    # The engine thread runs model calls between steps; ``take`` waits for them on a
    # worker thread (as its other CPU work), never on the event loop.
    def run_on_model(method, *args):
        return engine.call_model(method, *args).result()

    session = _session(engine.engine, dict(options), run_on_model=run_on_model)
    vad = _vad_plan(engine.engine, vad_filter, vad_parameters)
    if vad is None:
        async for item in _windows(engine, session, session.start(waveform), request_id, lora_request):
            yield item
        return
    from tandem.entrypoints.vad_batched import chunk_segments, merge

    chunks = await asyncio.to_thread(vad.chunks, waveform, f"request {request_id}")  # CPU work: off the event loop

    async def run(k: int, s: TranscriptionSession) -> Transcription:
        last = None
        async for item in _windows(engine, s, s.start(chunks[k].waveform), f"{request_id}-c{k}", lora_request):
            last = item
        return last

    results: list[Transcription] = []
    tasks: list[asyncio.Future] = []

    def so_far(k: int) -> WindowOutcome:  # merge() joins the chunks' texts so
        return WindowOutcome(False, chunk_segments(chunks[k], results[k]), " ".join(r.text for r in results if r.text))

    try:
        if chunks and _detects_language(engine.engine, options):  # the first chunk's language, for the others
            results.append(await run(0, session))
            yield so_far(0)
            session = _session(engine.engine, {**options, "language": results[0].language},
                               run_on_model=run_on_model)
        tasks = [asyncio.ensure_future(run(k, session)) for k in range(len(results), len(chunks))]
        for k, task in enumerate(tasks, start=len(results)):
            results.append(await task)
            yield so_far(k)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    yield merge(chunks, results, timestamps=bool(options.get("timestamps")),
                word_timestamps=bool(options.get("word_timestamps")), language=options.get("language"))


async def _windows(engine, session: TranscriptionSession, state: Any, request_id: str, lora_request: Any = None):
    """One session input's windows in turn (requests ``{request_id}-w{n}``): yields each
    window's outcome that has new segments or text, then the :class:`Transcription`."""
    n = 0
    while True:
        w = session.next_window(state)
        last = None
        async for out in engine.generate(w.prompt, w.params, f"{request_id}-w{n}", prompt_slot=w.prompt_slot,
                                         lora_request=lora_request):
            last = out
        n += 1
        if last.error is not None:
            raise ValueError(last.error)
        outcome = await asyncio.to_thread(session.take, state, last)
        if outcome.segments or outcome.text:
            yield outcome
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
