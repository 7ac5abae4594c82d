"""Whisper's transcription session: HF's Whisper ``generate``, window by window.

Each input is decoded window by window (HF's sequential algorithm). A window is
one request: 30 s of audio as the encoder prompt, and the decoder prompt HF
builds from the engine's generation config: ``<|startoftranscript|>``, the
language, the task and, without timestamps, ``<|notimestamps|>`` (after
``<|startofprev|>`` and the previous windows' text with
``condition_on_previous_text``). With ``language=None`` on a multilingual
checkpoint the first window's language is a prompt slot: that request's first
step picks the language token the model scores highest among the languages
(HF's ``detect_language``), then the task token follows, all in one request
with one encoder run; later windows reuse the language.

Short audio (<= 30 s) without timestamps is one window, its waveform the encoder
input (the log-mel runs batched on the device). With timestamps, or for longer
audio, the log-mel of the whole input is computed once (floored at the whole
input's max, as HF's extractor with ``truncation=False``), the windows are
slices of it, and after each window the input seeks to its last complete
timestamp segment (or past the window), as HF's ``_retrieve_segment``. With
several ``temperature`` values, a window whose compression ratio or average
log-probability crosses its threshold is decoded again at the next temperature
(HF's fallback). With ``no_speech_threshold`` each window's decoder prompt is
split at ``<|startoftranscript|>`` (a prompt slot whose one choice is the
language token, or the languages when detecting): the slot step reads the
probability of ``<|nospeech|>`` there, on the raw logits, as HF's
``WhisperNoSpeechDetection``, and a window above the threshold whose average
log-probability is below ``logprob_threshold`` is skipped as silence. An
English-only checkpoint with timestamps has nothing after
``<|startoftranscript|>`` to split at (HF reads its first generated step's raw
scores): its windows recompute those logits on the model once decoded.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace

import torch

from tandem.core.inputs import EncoderInputs, PromptSlot
from tandem.core.sampling_params import RequestOutputKind, SamplingParams
from tandem.core.transcription import (
    Transcription,
    TranscriptionContext,
    TranscriptionOptions,
    TranscriptionSession,
    WindowOutcome,
    WindowRequest,
)
from tandem.model_zoo.whisper.alignment import alignment_heads, token_timestamps
from tandem.model_zoo.whisper.audio import log_mel, num_frames, pad_to_window
from tandem.model_zoo.whisper.constants import FRAME_SECONDS, SAMPLE_RATE, WINDOW_FRAMES, WINDOW_SAMPLES
from tandem.model_zoo.whisper.prompts import WhisperPrompts
from tandem.model_zoo.whisper.timestamps import TimestampRules, retrieve_segments
from tandem.model_zoo.whisper.words import timed_words


def compression_ratio(tokens: list[int], vocab_size: int) -> float:
    """HF's ``_retrieve_compression_ratio``: token bytes over their zlib size."""
    width = int(math.log2(vocab_size) / 8) + 1
    data = b"".join(t.to_bytes(width, "little") for t in tokens)
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _threshold(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number or None")
    return float(value)


@dataclass
class _Input:
    """One input's progress through its windows."""

    waveform: torch.Tensor
    features: torch.Tensor | None = None  # log-mel of the whole input (windowed decoding)
    max_frames: int = WINDOW_FRAMES
    seek: int = 0
    language: int | None = None  # the language token, once known
    segments: list[dict] = field(default_factory=list)
    fallback: int = 0  # index into the temperatures of the window in flight
    windows: int = 0
    condition: bool = False  # the next window is conditioned on the previous text
    audio_frames: int = 0  # log-mel frames of the audio itself (HF's attention-mask length)
    window_input: torch.Tensor | None = None  # the window in flight's encoder input (recomputes)
    last_time: float = 0.0  # the timestamp of the input's last token so far (word timestamps)
    probe_by_model: bool = False  # the window in flight reads its no-speech probability on the model


class WhisperTranscription(TranscriptionSession):
    """The window-by-window state machine of one ``transcribe`` call."""

    def __init__(self, model_cls, ctx: TranscriptionContext, options: TranscriptionOptions) -> None:
        self.ctx, cfg = ctx, ctx.hf_config
        self.prompts = prompts = WhisperPrompts.from_generation_config(ctx.generation_config, cfg)
        o = options
        if o.timestamps and prompts.no_timestamps is None:
            raise ValueError("timestamps=True: the generation config has no no_timestamps_token_id")
        prompts.decoder_prompt(o.language, o.task, o.timestamps)  # checks language and task up front
        sampling = dict(o.sampling)
        temperatures = sampling.pop("temperature", None)
        self.temperatures = list(temperatures) if isinstance(temperatures, (list, tuple)) else [temperatures]
        if not self.temperatures:
            raise ValueError("temperature=(): give at least one temperature")
        self.base = SamplingParams(**sampling) if sampling else SamplingParams()
        self.language, self.task, self.timestamps = o.language, o.task, o.timestamps
        self.condition_on_previous_text = o.condition_on_previous_text
        self.ratio_threshold, self.logprob_threshold = o.compression_ratio_threshold, o.logprob_threshold
        self.prompt_ids = list(o.prompt_ids)
        self.no_speech_threshold = _threshold("no_speech_threshold", o.no_speech_threshold)
        self.no_speech_token = None
        if self.no_speech_threshold is not None:
            if prompts.no_timestamps is None:
                raise ValueError("no_speech_threshold: the generation config has no no_timestamps_token_id (HF reads "
                                 "the no-speech token just before it)")
            self.no_speech_token = prompts.no_timestamps - 1  # <|nospeech|>, as HF finds it
            if ctx.run_on_model is None and not prompts.multilingual:
                raise ValueError("no_speech_threshold on an English-only checkpoint: this caller cannot run the "
                                 "model between steps (the transcription context has no run_on_model), which "
                                 "reads the no-speech probability of windows with timestamps")
        self.rules = TimestampRules(prompts) if prompts.no_timestamps is not None else None
        self.cut_off = model_cls.max_decoder_len(cfg) // 2 - 1
        self.vocab_size = model_cls.vocab_size(cfg)
        self.n_mels = int(cfg.num_mel_bins)
        self.num_positions = int(cfg.max_source_positions)
        self.word_timestamps = o.word_timestamps
        if o.word_timestamps:
            self.alignment_heads = alignment_heads(ctx.generation_config, cfg)
            self.median_filter_width = int(getattr(cfg, "median_filter_width", 7))
            if ctx.run_on_model is None:
                raise ValueError("word_timestamps=True: this caller cannot run the model between steps (the "
                                 "transcription context has no run_on_model), which recomputes each window's "
                                 "cross-attention")

    def start(self, waveform: torch.Tensor) -> _Input:
        return _Input(waveform, audio_frames=num_frames(waveform.numel()))

    def windowed(self, inp: _Input) -> bool:
        return self.timestamps or inp.waveform.numel() > WINDOW_SAMPLES

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

    def _encoder_prompt(self, inp: _Input, long: bool):
        if not long:
            if self.word_timestamps or inp.probe_by_model:
                inp.window_input = pad_to_window(inp.waveform)
            return {"audio": inp.waveform, "sampling_rate": SAMPLE_RATE}
        if inp.features is None:
            wave = inp.waveform
            if wave.numel() <= WINDOW_SAMPLES:  # short audio: HF pads it to the 30 s window
                wave = torch.nn.functional.pad(wave, (0, WINDOW_SAMPLES - wave.numel()))
                inp.max_frames = WINDOW_FRAMES
            else:
                inp.max_frames = num_frames(wave.numel())
            inp.features = log_mel(wave, self.n_mels)[0]
        num = min(WINDOW_FRAMES, inp.max_frames - inp.seek)
        window = inp.features[:, inp.seek : inp.seek + num]
        window = torch.nn.functional.pad(window, (0, WINDOW_FRAMES - window.shape[1]))
        inp.window_input = window if self.word_timestamps or inp.probe_by_model else None
        return EncoderInputs(num_positions=self.num_positions, features=window)

    def next_window(self, inp: _Input) -> WindowRequest:
        prompts = self.prompts
        long = self.windowed(inp)
        init, slot = prompts.decoder_prompt(self.language, self.task, long)
        if inp.language is not None and slot is not None:  # detected in an earlier window
            init, slot = [init[0], inp.language, *slot.then], None
        if self.no_speech_token is not None:  # the prompt ends at <|startoftranscript|> for the slot step to probe
            if slot is not None:
                slot = replace(slot, probe=self.no_speech_token)
            elif len(init) > 1:
                init, slot = init[:1], PromptSlot((init[1],), tuple(init[2:]), self.no_speech_token)
        # English-only with timestamps: the prompt ends at <|startoftranscript|>, so the
        # first generated step reads there (HF takes those scores, before any processor);
        # the decode path reports no raw logits, so take() recomputes them on the model.
        inp.probe_by_model = self.no_speech_token is not None and slot is None
        encoder = self._encoder_prompt(inp, long)
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
        return WindowRequest(prompt, self._params(inp, long), slot)

    def take(self, inp: _Input, out) -> WindowOutcome:
        prompts = self.prompts
        c = out.outputs[0]
        tokens = list(c.token_ids)
        if inp.language is None and prompts.multilingual and self.language is None:
            pos = prompts.language_position(out.prompt_token_ids)
            inp.language = out.prompt_token_ids[pos] if pos is not None else None
        avg_logprob = self._avg_logprob(tokens, c)
        no_speech_prob = self._no_speech_prob(inp, out.prompt_token_ids) if inp.probe_by_model else out.probe_prob
        skip = self._is_silence(no_speech_prob, avg_logprob)
        if not skip and self._needs_fallback(tokens, avg_logprob) and inp.fallback < len(self.temperatures) - 1:
            inp.fallback += 1
            return WindowOutcome(done=False)
        # HF conditions the next window only after a low-temperature decode (a skipped one too).
        used = self.temperatures[inp.fallback]
        inp.condition = self.condition_on_previous_text and (used is None or used < 0.5)
        inp.fallback = 0
        times = self._token_times(inp, out.prompt_token_ids, tokens) if self.word_timestamps and not skip else None
        if tokens and tokens[-1] == prompts.eos:
            tokens = tokens[:-1]
        if not self.windowed(inp):
            inp.segments = [] if skip else [{"start": 0.0, "end": inp.waveform.numel() / SAMPLE_RATE, "tokens": tokens}]
            self._mark(inp.segments, no_speech_prob)
            self._words(inp, inp.segments, times)
            return WindowOutcome(done=True, text=self._text(tokens if not skip else []))
        num = min(WINDOW_FRAMES, inp.max_frames - inp.seek)
        if tokens and not skip:  # HF: a skipped window seeks past itself and adds nothing
            segments, advance = retrieve_segments(tokens, prompts.timestamp_begin, inp.seek * FRAME_SECONDS, num)
        else:
            segments, advance = [], num
        self._mark(segments, no_speech_prob)
        self._words(inp, segments, times)
        inp.segments += segments
        inp.seek += advance
        text = self._text([t for seg in inp.segments for t in seg["tokens"]])  # as result() makes it
        return WindowOutcome(inp.seek >= inp.max_frames, [self._segment(s) for s in segments], text)

    def _no_speech_prob(self, inp: _Input, prompt: list[int]) -> float:
        """HF's ``WhisperNoSpeechDetection`` where the prompt ends at ``<|startoftranscript|>``:
        the probability of ``<|nospeech|>`` in the softmax of the raw logits there."""
        prompt = list(prompt)
        logits = self.ctx.run_on_model("next_token_logits", inp.window_input, prompt)
        return float(torch.softmax(logits, dim=-1)[self.no_speech_token])

    def _token_times(self, inp: _Input, prompt: list[int], generated: list[int]) -> list[float]:
        """Each generated token's timestamp (seconds in the input), HF's ``return_token_timestamps``:
        the alignment heads' cross-attention recomputed on the model, then DTW (``alignment.py``)."""
        if not generated:
            return []
        prompt, heads = list(prompt), self.alignment_heads
        weights = self.ctx.run_on_model("alignment_attention", inp.window_input, prompt + generated[:-1], heads,
                                        len(prompt))
        rel = token_timestamps(weights, len(prompt), len(generated), median_filter_width=self.median_filter_width,
                               num_frames=inp.audio_frames - inp.seek)
        offset = inp.seek * FRAME_SECONDS
        return [t + offset for t in rel[len(prompt):]]

    def _words(self, inp: _Input, segments: list[dict], times: list[float] | None) -> None:
        """Give each segment its tokens' timestamps and its words (HF's pipeline: a text
        token spans the previous token's timestamp to its own)."""
        if times is None:
            return
        lang = self._language(inp)
        at = 0
        for seg in segments:
            toks = seg["tokens"]
            seg["token_timestamps"] = seg_times = times[at : at + len(toks)]
            at += len(toks)
            text, spans = [], []
            for t, end in zip(toks, seg_times):
                if t < self.prompts.eos:
                    text.append(t)
                    spans.append((inp.last_time, end))
                inp.last_time = end
            # Without a tokenizer there are no words to find: the token timestamps only.
            seg["words"] = timed_words(self.ctx.tokenizer, text, spans, lang) if self.ctx.tokenizer else None

    def _avg_logprob(self, tokens: list[int], completion) -> float | None:
        """HF's ``_retrieve_avg_logprobs``: the text tokens' log-probabilities over their
        count + 1 (None when the window's logprobs were not asked for)."""
        if not completion.logprobs:
            return None
        chosen = [step[t] for step, t in zip(completion.logprobs, tokens)]
        text = [lp for lp, t in zip(chosen, tokens) if t != self.prompts.eos]
        return sum(text) / (len(text) + 1)

    def _needs_fallback(self, tokens: list[int], avg_logprob: float | None) -> bool:
        """HF's ``_need_fallback`` on compression ratio and average log-probability."""
        if self.ratio_threshold is not None and compression_ratio(tokens, self.vocab_size) > self.ratio_threshold:
            return True
        return self.logprob_threshold is not None and avg_logprob is not None and avg_logprob < self.logprob_threshold

    def _is_silence(self, no_speech_prob: float | None, avg_logprob: float | None) -> bool:
        """HF's skip: no-speech probability above its threshold and the average
        log-probability below ``logprob_threshold``; without a ``logprob_threshold``,
        the probability alone (faster-whisper's rule)."""
        if self.no_speech_threshold is None or no_speech_prob is None:
            return False
        if no_speech_prob <= self.no_speech_threshold:
            return False
        return self.logprob_threshold is None or (avg_logprob is not None and avg_logprob < self.logprob_threshold)

    def _mark(self, segments: list[dict], no_speech_prob: float | None) -> None:
        if self.no_speech_threshold is not None:
            for seg in segments:
                seg["no_speech_prob"] = no_speech_prob

    def _segment(self, seg: dict) -> dict:
        out = {"start": round(seg["start"], 3), "end": round(seg["end"], 3), "text": self._text(seg["tokens"]),
               "token_ids": list(seg["tokens"])}
        if "no_speech_prob" in seg:
            out["no_speech_prob"] = seg["no_speech_prob"]
        if "token_timestamps" in seg:
            if seg["words"] is not None:
                out["words"] = seg["words"]
            out["token_timestamps"] = [round(t, 3) for t in seg["token_timestamps"]]
        return out

    def _language(self, inp: _Input) -> str | None:
        prompts = self.prompts
        if not prompts.multilingual:
            return "en"
        if inp.language is not None:
            return prompts.language_code(inp.language)
        return prompts.language_code(prompts.language_id(self.language)) if self.language is not None else None

    def result(self, inp: _Input) -> Transcription:
        prompts = self.prompts
        tokens = [t for seg in inp.segments for t in seg["tokens"]]
        segments = [self._segment(s) for s in inp.segments] if self.timestamps else None
        words = None
        if self.word_timestamps and self.ctx.tokenizer is not None:
            words = [w for seg in inp.segments for w in seg["words"] or ()]
        return Transcription(text=self._text(tokens), token_ids=tokens, language=self._language(inp),
                             segments=segments, words=words, windows=inp.windows)

    def _text(self, ids: list[int]) -> str:
        tokenizer = self.ctx.tokenizer
        if tokenizer is None:
            return ""
        if self.prompts.no_timestamps is not None:
            ids = [t for t in ids if t < self.prompts.timestamp_begin]
        return tokenizer.decode(ids, skip_special_tokens=True).strip()
