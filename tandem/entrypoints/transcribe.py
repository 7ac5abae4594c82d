"""``LLM.transcribe``: audio in, transcripts out, for Whisper checkpoints, as HF's
Whisper ``generate`` does it.

Each input is decoded window by window (HF's sequential algorithm). A window is
one request: 30 s of log-mel features as the encoder prompt, and the decoder
prompt HF builds from the checkpoint's generation config:
``<|startoftranscript|>``, the language, the task and, without timestamps,
``<|notimestamps|>`` (after ``<|startofprev|>`` and the previous windows' text
with ``condition_on_previous_text``). With ``language=None`` on a multilingual
checkpoint the first window's language is a prompt slot
(:class:`tandem.core.sequence.PromptSlot`): that request's first step picks the
language token the model scores highest among the languages (HF's
``detect_language``), then the task token follows, all in one request with one
encoder run; later windows reuse the language.

Short audio (<= 30 s) without timestamps is one window, its waveform the encoder
input (the log-mel runs batched on the device). With timestamps, or for longer
audio, the log-mel of the whole input is computed once (floored at the whole
input's max, as HF's extractor with ``truncation=False``), the windows are
slices of it, and after each window the input seeks to its last complete
timestamp segment (or past the window), as HF's ``_retrieve_segment``. Windows
of different inputs run concurrently in the engine, one window per input in
flight. With several ``temperature`` values, a window whose compression ratio or
average log-probability crosses its threshold is decoded again at the next
temperature (HF's fallback).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.core.sampling_params import RequestOutputKind, SamplingParams
from tandem.model_zoo.whisper import TASKS, WhisperPrompts

if TYPE_CHECKING:
    from tandem.entrypoints.llm import LLM

WINDOW = 30 * 16000  # samples
WINDOW_FRAMES = 3000  # log-mel frames
TIME_PRECISION = 0.02  # seconds per timestamp token step
FRAME_SECONDS = 0.01  # seconds per log-mel frame
INPUT_STRIDE = 2  # log-mel frames per encoder position


@dataclass
class Transcription:
    """One input's transcript. ``error`` is set (and the rest empty) when the input
    could not be served; ``language`` is the language code (``"en"``), detected or given."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    language: str | None = None
    segments: list[dict] | None = None
    error: str | None = None
    windows: int = 0  # 30 s windows decoded, fallback re-decodes included


class TimestampRules:
    """HF's ``WhisperTimeStampLogitsProcessor`` as a per-request logits processor
    (tandem's three-argument signature; ``prompt_ids`` is the window's decoder
    prompt, so HF's ``begin_index`` is its length): timestamps come in pairs except
    before EOS, never decrease, the first token is a timestamp at most
    ``max_initial_timestamp_index`` steps in, and a timestamp is forced when the
    timestamps' total probability beats every text token's."""

    def __init__(self, prompts: WhisperPrompts) -> None:
        self.no_timestamps = prompts.no_timestamps
        self.tb = prompts.timestamp_begin
        self.eos = prompts.eos
        self.max_initial = prompts.max_initial_timestamp_index

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        tb, inf = self.tb, -float("inf")
        logits[self.no_timestamps] = inf
        seq = output_ids
        last_ts = len(seq) >= 1 and seq[-1] >= tb
        penultimate_ts = len(seq) < 2 or seq[-2] >= tb
        if last_ts:
            if penultimate_ts:
                logits[tb:] = inf
            else:
                logits[: self.eos] = inf
        stamps = [t for t in seq if t >= tb]
        if stamps:
            last = stamps[-1] if (last_ts and not penultimate_ts) else stamps[-1] + 1
            logits[tb:last] = inf
        if not seq:
            logits[:tb] = inf
            if self.max_initial is not None:
                logits[tb + self.max_initial + 1:] = inf
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if logprobs[tb:].logsumexp(dim=-1) > logprobs[:tb].max():
            logits[:tb] = inf
        return logits


def retrieve_segments(
    tokens: list[int], tb: int, time_offset: float, seek_num_frames: int
) -> tuple[list[dict], int]:
    """HF's ``_retrieve_segment`` for one window's generated tokens (trailing EOS
    removed): its timestamp segments and how many frames the input seeks forward."""
    is_ts = [t >= tb for t in tokens]
    single_ending = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(is_ts) - 1) if is_ts[i] and is_ts[i + 1]]
    if cuts:
        segments = []
        if single_ending:
            cuts.append(len(tokens))
        else:
            cuts[-1] += 1
        last = 0
        for k, cut in enumerate(cuts):
            piece = tokens[last:cut]
            end_at = -1 if (k < len(cuts) - 1 or single_ending) else -2
            segments.append({
                "start": time_offset + (piece[0] - tb) * TIME_PRECISION,
                "end": time_offset + (piece[end_at] - tb) * TIME_PRECISION,
                "tokens": piece,
            })
            last = cut
        if single_ending:
            offset = seek_num_frames
        else:
            offset = (tokens[last - 2] - tb) * INPUT_STRIDE
        return segments, offset
    stamps = [i for i, t in enumerate(is_ts) if t]
    end = seek_num_frames * FRAME_SECONDS
    if stamps and tokens[stamps[-1]] != tb:
        end = (tokens[stamps[-1]] - tb) * TIME_PRECISION
    return [{"start": time_offset, "end": time_offset + end, "tokens": list(tokens)}], seek_num_frames


def compression_ratio(tokens: list[int], vocab_size: int) -> float:
    """HF's ``_retrieve_compression_ratio``: token bytes over their zlib size."""
    width = int(math.log2(vocab_size) / 8) + 1
    data = b"".join(t.to_bytes(width, "little") for t in tokens)
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass
class _Input:
    """One input's progress through its windows."""

    index: int
    waveform: torch.Tensor
    features: torch.Tensor | None = None  # log-mel of the whole input (windowed decoding)
    max_frames: int = WINDOW_FRAMES
    seek: int = 0
    language: int | None = None  # the language token, once known
    segments: list[dict] = field(default_factory=list)
    fallback: int = 0  # index into the temperatures of the window in flight
    windows: int = 0
    condition: bool = False  # the next window is conditioned on the previous text


class Transcriber:
    """The window-by-window state machine of one ``transcribe`` call, independent
    of how requests reach the engine (``LLM``'s step loop or ``AsyncLLM``):
    :meth:`request` says what to run for an input's next window,
    :meth:`take` digests its output, :meth:`result` builds the transcript."""

    def __init__(
        self,
        engine,
        *,
        language: str | None = None,
        task: str = "transcribe",
        timestamps: bool = False,
        condition_on_previous_text: bool = False,
        compression_ratio_threshold: float | None = None,
        logprob_threshold: float | None = None,
        prompt_ids: list[int] | None = None,
        **sampling: Any,
    ) -> None:
        """``engine``: the ``LLMEngine``. ``prompt_ids``: text tokens to prompt the
        first window with (after ``<|startofprev|>``), as HF's ``prompt_ids``."""
        from tandem.core.model import EncoderDecoderModel

        model_cls = engine.model_cls
        if model_cls.get_audio_encoder_inputs.__func__ is EncoderDecoderModel.get_audio_encoder_inputs.__func__:
            raise ValueError(f"{engine.architecture} takes no audio: transcribe needs an audio model such as Whisper")
        self.engine = engine
        self.prompts = prompts = WhisperPrompts.from_model(engine.config.model, engine.hf_config)
        if timestamps and prompts.no_timestamps is None:
            raise ValueError("timestamps=True: the checkpoint's generation config has no no_timestamps_token_id")
        prompts.decoder_prompt(language, task, timestamps)  # checks language and task up front
        temperatures = sampling.pop("temperature", None)
        self.temperatures = list(temperatures) if isinstance(temperatures, (list, tuple)) else [temperatures]
        if not self.temperatures:
            raise ValueError("temperature=(): give at least one temperature")
        self.base = SamplingParams(**sampling) if sampling else SamplingParams()
        self.language, self.task, self.timestamps = language, task, timestamps
        self.condition_on_previous_text = condition_on_previous_text
        self.ratio_threshold, self.logprob_threshold = compression_ratio_threshold, logprob_threshold
        self.prompt_ids = list(prompt_ids or [])
        self.rules = TimestampRules(prompts) if prompts.no_timestamps is not None else None
        self.cut_off = model_cls.max_decoder_len(engine.hf_config) // 2 - 1

    def windowed(self, inp: _Input) -> bool:
        return self.timestamps or inp.waveform.numel() > WINDOW

    def _params(self, inp: _Input, long: bool) -> SamplingParams:
        t = self.temperatures[inp.fallback]
        changes: dict = {"output_kind": RequestOutputKind.FINAL_ONLY}
        if t is not None:
            changes["temperature"] = t
            if t > 0:
                changes["num_beams"] = 1
        if self.logprob_threshold is not None and self.base.logprobs is None:
            changes["logprobs"] = 0
        if long and self.rules is not None:
            changes["logits_processors"] = (*self.base.logits_processors, self.rules)
        return self.base.replace(**changes)

    def request(self, inp: _Input) -> tuple[dict, SamplingParams, Any]:
        """The next window's prompt, params and prompt slot."""
        from tandem.audio import log_mel_spectrogram
        from tandem.core.inputs import EncoderInputs

        prompts, cfg = self.prompts, self.engine.hf_config
        long = self.windowed(inp)
        init, slot = prompts.decoder_prompt(self.language, self.task, long)
        if inp.language is not None and slot is not None:  # detected in an earlier window
            init, slot = [init[0], inp.language, *slot.then], None
        if long:
            if inp.features is None:
                wave = inp.waveform
                if wave.numel() <= WINDOW:  # short audio: HF pads it to the 30 s window
                    wave = torch.nn.functional.pad(wave, (0, WINDOW - wave.numel()))
                    inp.max_frames = WINDOW_FRAMES
                else:
                    inp.max_frames = -(-wave.numel() // 160)  # HF's frame-rate attention mask
                inp.features = log_mel_spectrogram(wave, cfg.num_mel_bins, any_length=True)[0]
            num = min(WINDOW_FRAMES, inp.max_frames - inp.seek)
            window = inp.features[:, inp.seek : inp.seek + num]
            window = torch.nn.functional.pad(window, (0, WINDOW_FRAMES - window.shape[1]))
            encoder = EncoderInputs(num_positions=int(cfg.max_source_positions), features=window)
        else:
            encoder = {"audio": inp.waveform, "sampling_rate": 16000}
        prev = None
        if inp.condition and inp.segments:  # HF: <|startofprev|> + earlier windows' tokens
            prev = []
            for seg in inp.segments:
                toks = seg["tokens"]
                prev += toks[:-1] if len(toks) > 2 and toks[-2] >= prompts.timestamp_begin else toks
        elif self.prompt_ids and not inp.segments:
            prev = self.prompt_ids
        decoder = list(init)
        if prev is not None:
            start = [prompts.prev_sot] if prompts.prev_sot is not None else []
            decoder = start + prev[-self.cut_off:] + decoder
        inp.windows += 1
        prompt = {"encoder_prompt": encoder, "decoder_prompt": {"prompt_token_ids": decoder}}
        return prompt, self._params(inp, long), slot

    def take(self, inp: _Input, out) -> bool:
        """Digest a finished window's output; returns whether the input is done."""
        prompts = self.prompts
        c = out.outputs[0]
        tokens = list(c.token_ids)
        if inp.language is None and prompts.multilingual and self.language is None:
            lang_pos = _language_position(out.prompt_token_ids, prompts)
            inp.language = out.prompt_token_ids[lang_pos] if lang_pos is not None else None
        needs = _needs_fallback(tokens, c, prompts, self.engine.vocab_size, self.ratio_threshold, self.logprob_threshold)
        if needs and inp.fallback < len(self.temperatures) - 1:
            inp.fallback += 1
            return False
        # HF conditions the next window only after a low-temperature decode.
        used = self.temperatures[inp.fallback]
        inp.condition = self.condition_on_previous_text and (used is None or used < 0.5)
        inp.fallback = 0
        if tokens and tokens[-1] == prompts.eos:
            tokens = tokens[:-1]
        if not self.windowed(inp):
            inp.segments = [{"start": 0.0, "end": inp.waveform.numel() / 16000, "tokens": tokens}]
            return True
        num = min(WINDOW_FRAMES, inp.max_frames - inp.seek)
        if tokens:
            segments, advance = retrieve_segments(tokens, prompts.timestamp_begin, inp.seek * FRAME_SECONDS, num)
        else:
            segments, advance = [], num
        inp.segments += segments
        inp.seek += advance
        return inp.seek >= inp.max_frames

    def result(self, inp: _Input, tokenizer) -> Transcription:
        return _result(inp, self.prompts, self.language, tokenizer, self.timestamps)


# What ``pip install 'tandem-engine[audio]'`` brings: soundfile decodes files, soxr resamples.
AUDIO_EXTRA_MODULES = ("soundfile", "soxr")


def require_audio_extra() -> None:
    """Raise ImportError naming the audio extra and each of its modules that does not
    import, so ``tandem transcribe`` says so before it loads a model rather than
    failing every file on the first missing module, then on the next."""
    import importlib

    missing = []
    for name in AUDIO_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            missing.append(name)
        except (ImportError, OSError) as e:  # installed but broken, e.g. soundfile without its libsndfile
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise ImportError(
            f"transcribing files needs the audio extra: pip install 'tandem-engine[audio]' "
            f"(missing: {', '.join(missing)})"
        )


def transcribe(
    llm: "LLM",
    audio: Any,
    *,
    sampling_rate: int | None = None,
    use_tqdm: bool = True,
    **options: Any,
) -> list[Transcription]:
    """See :meth:`tandem.LLM.transcribe` (``options``: :class:`Transcriber`'s)."""
    from tandem.audio import AudioError, load_audio

    engine = llm.llm_engine
    t = Transcriber(engine, **options)
    items = audio if isinstance(audio, list) else [audio]
    results: list[Transcription | None] = [None] * len(items)
    inputs: list[_Input] = []
    for i, item in enumerate(items):
        try:
            inputs.append(_Input(i, load_audio(*_source(item, sampling_rate))))
        except (AudioError, ValueError, TypeError) as e:
            results[i] = Transcription(error=str(e))

    def submit(inp: _Input) -> str:
        prompt, params, slot = t.request(inp)
        rid = f"transcribe-{next(llm._ids)}"
        engine.add_request(rid, prompt, params, prompt_slot=slot)
        return rid

    with llm._lock:
        in_flight: dict[str, _Input] = {}
        bar = _bar(len(inputs), use_tqdm)
        try:
            for inp in inputs:
                try:
                    in_flight[submit(inp)] = inp
                except (ValueError, TypeError) as e:
                    results[inp.index] = Transcription(error=str(e))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    inp = in_flight.pop(out.request_id, None)
                    if inp is None or not out.finished:
                        continue
                    if out.error is not None:
                        results[inp.index] = Transcription(error=out.error)
                        bar.update(1)
                        continue
                    if t.take(inp, out):
                        results[inp.index] = t.result(inp, llm.get_tokenizer())
                        bar.update(1)
                    else:
                        try:
                            in_flight[submit(inp)] = inp
                        except (ValueError, TypeError) as e:
                            results[inp.index] = Transcription(error=str(e))
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(in_flight))
            raise
        finally:
            bar.close()
    return results  # type: ignore[return-value]


async def transcribe_async(engine, waveform: torch.Tensor, request_id: str, **options: Any):
    """One input through an ``AsyncLLM``, window by window: yields each window's new
    segments as it finishes, then the final :class:`Transcription`."""
    t = Transcriber(engine.engine, **options)
    inp = _Input(0, waveform)
    n = 0
    while True:
        prompt, params, slot = t.request(inp)
        last = None
        async for out in engine.generate(prompt, params, f"{request_id}-w{n}", prompt_slot=slot):
            last = out
        n += 1
        if last.error is not None:
            raise ValueError(last.error)
        before = len(inp.segments)
        done = t.take(inp, last)
        if len(inp.segments) > before and t.windowed(inp):
            tok = engine.get_tokenizer()
            yield [{"start": round(seg["start"], 3), "end": round(seg["end"], 3),
                    "text": _text(seg["tokens"], t.prompts, tok), "token_ids": list(seg["tokens"])}
                   for seg in inp.segments[before:]]
        if done:
            yield t.result(inp, engine.get_tokenizer())
            return


def _language_position(prompt_ids: list[int], prompts: WhisperPrompts) -> int | None:
    try:
        start = prompt_ids.index(prompts.start)
    except ValueError:
        return None
    return start + 1 if start + 1 < len(prompt_ids) and prompt_ids[start + 1] in prompts.lang_to_id.values() else None


def _needs_fallback(tokens, completion, prompts, vocab, ratio_threshold, logprob_threshold) -> bool:
    """HF's ``_need_fallback`` on compression ratio and average log-probability."""
    if ratio_threshold is not None and compression_ratio(tokens, vocab) > ratio_threshold:
        return True
    if logprob_threshold is not None and completion.logprobs:
        chosen = [step[t] for step, t in zip(completion.logprobs, tokens)]
        text = [lp for lp, t in zip(chosen, tokens) if t != prompts.eos]
        if sum(text) / (len(text) + 1) < logprob_threshold:
            return True
    return False


def _source(item: Any, sampling_rate: int | None) -> tuple[Any, int | None]:
    if isinstance(item, dict):
        unknown = set(item) - {"audio", "sampling_rate"}
        if "audio" not in item or unknown:
            raise ValueError(f"an audio input dict has 'audio' and 'sampling_rate', got keys {sorted(item)}")
        return item["audio"], item.get("sampling_rate", sampling_rate)
    if isinstance(item, (str, Path)):
        return item, None
    return item, sampling_rate


def _result(inp: _Input, prompts: WhisperPrompts, language: str | None, tokenizer, timestamps: bool) -> Transcription:
    tokens = [t for seg in inp.segments for t in seg["tokens"]]
    if prompts.multilingual:
        lang = prompts.language_code(inp.language) if inp.language is not None else (
            prompts.language_code(prompts.language_id(language)) if language is not None else None
        )
    else:
        lang = "en"

    def text_of(ids: list[int]) -> str:
        return _text(ids, prompts, tokenizer)

    segments = None
    if timestamps:
        segments = [{"start": round(s["start"], 3), "end": round(s["end"], 3), "text": text_of(s["tokens"]),
                     "token_ids": list(s["tokens"])} for s in inp.segments]
    return Transcription(text=text_of(tokens), token_ids=tokens, language=lang, segments=segments, windows=inp.windows)


def _text(ids: list[int], prompts: WhisperPrompts, tokenizer) -> str:
    if tokenizer is None:
        return ""
    if prompts.no_timestamps is not None:
        ids = [t for t in ids if t < prompts.timestamp_begin]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Transcribing", disable=not enabled, unit="input")
