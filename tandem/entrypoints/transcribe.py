"""``LLM.transcribe``: audio in, transcripts out, for Whisper checkpoints.

Each input becomes one request: its audio as the encoder prompt, and the decoder
prompt HF ``generate`` would build from the checkpoint's generation config:
``<|startoftranscript|>``, the language, the task and ``<|notimestamps|>``. With
``language=None`` on a multilingual checkpoint the language is a prompt slot
(:class:`tandem.core.sequence.PromptSlot`): the request's first step picks the
language token the model scores highest among the languages (HF's
``detect_language``), and the task and ``<|notimestamps|>`` follow, all in one
request with one encoder run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.core.sampling_params import RequestOutputKind, SamplingParams
from tandem.core.sequence import PromptSlot

if TYPE_CHECKING:
    from tandem.entrypoints.llm import LLM

TASKS = ("transcribe", "translate")
WINDOW = 30 * 16000


@dataclass
class Transcription:
    """One input's transcript. ``error`` is set (and the rest empty) when the input
    could not be served; ``language`` is the language code (``"en"``), detected or given."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    language: str | None = None
    segments: list[dict] | None = None
    error: str | None = None


@dataclass(frozen=True)
class WhisperPrompts:
    """The special tokens of a Whisper checkpoint's generation config."""

    start: int
    lang_to_id: dict[str, int]  # "<|en|>" -> id
    task_to_id: dict[str, int]
    no_timestamps: int | None
    multilingual: bool

    @classmethod
    def from_model(cls, model_dir: str, hf_config) -> "WhisperPrompts":
        from transformers import GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(model_dir)
        except OSError as e:
            raise ValueError(f"{model_dir}: transcribe needs the checkpoint's generation_config.json ({e})") from e
        start = gen.decoder_start_token_id if gen.decoder_start_token_id is not None else hf_config.decoder_start_token_id
        lang = dict(getattr(gen, "lang_to_id", None) or {})
        return cls(
            int(start), lang, dict(getattr(gen, "task_to_id", None) or {}),
            getattr(gen, "no_timestamps_token_id", None),
            bool(getattr(gen, "is_multilingual", bool(lang))) and bool(lang),
        )

    def language_id(self, language: str) -> int:
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        key = language.lower()
        if key in TO_LANGUAGE_CODE:
            key = TO_LANGUAGE_CODE[key]
        token = key if key.startswith("<|") else f"<|{key}|>"
        if token not in self.lang_to_id:
            known = ", ".join(sorted(t.strip("<|>") for t in self.lang_to_id)) or "none (English-only model)"
            raise ValueError(f"language={language!r} is not one of this checkpoint's languages: {known}")
        return self.lang_to_id[token]

    def language_code(self, token_id: int) -> str | None:
        for token, i in self.lang_to_id.items():
            if i == token_id:
                return token.strip("<|>")
        return None

    def decoder_prompt(self, language: str | None, task: str, timestamps: bool) -> tuple[list[int], PromptSlot | None]:
        """The decoder prompt, and the slot the model fills when the language is to be detected."""
        if task not in TASKS:
            raise ValueError(f"task={task!r}: must be one of {', '.join(TASKS)}")
        tail = [] if timestamps or self.no_timestamps is None else [self.no_timestamps]
        if not self.multilingual:  # English-only: no language or task tokens
            if task != "transcribe" or (language is not None and language.lower() not in ("en", "english")):
                raise ValueError(
                    f"language={language!r}, task={task!r}: this checkpoint is English-only (it transcribes English)"
                )
            return [self.start, *tail], None
        if task not in self.task_to_id:
            raise ValueError(f"task={task!r}: this checkpoint's generation config has no token for it")
        tail = [self.task_to_id[task], *tail]
        if language is None:
            return [self.start], PromptSlot(tuple(self.lang_to_id.values()), tuple(tail))
        return [self.start, self.language_id(language), *tail], None


def transcribe(
    llm: "LLM",
    audio: Any,
    *,
    language: str | None = None,
    task: str = "transcribe",
    timestamps: bool = False,
    sampling_rate: int | None = None,
    use_tqdm: bool = True,
    **sampling: Any,
) -> list[Transcription]:
    """See :meth:`tandem.LLM.transcribe`."""
    from tandem.audio import AudioError, load_audio
    from tandem.core.model import EncoderDecoderModel

    engine = llm.llm_engine
    takes_audio = engine.model_cls.get_audio_encoder_inputs.__func__ is not EncoderDecoderModel.get_audio_encoder_inputs.__func__
    if not takes_audio:
        raise ValueError(f"{engine.architecture} takes no audio: transcribe needs an audio model such as Whisper")
    if timestamps:
        raise NotImplementedError("timestamps=True is not supported yet (transcripts without timestamps are)")
    prompts_info = WhisperPrompts.from_model(engine.config.model, engine.hf_config)
    decoder, slot = prompts_info.decoder_prompt(language, task, timestamps)
    items = audio if isinstance(audio, list) else [audio]
    params = SamplingParams(**sampling).replace(output_kind=RequestOutputKind.FINAL_ONLY) if sampling else SamplingParams(
        output_kind=RequestOutputKind.FINAL_ONLY
    )

    results: list[Transcription | None] = [None] * len(items)
    requests: dict[str, int] = {}
    with llm._lock:
        try:
            for i, item in enumerate(items):
                rid = f"transcribe-{next(llm._ids)}"
                try:
                    waveform = load_audio(*_source(item, sampling_rate))
                    if waveform.numel() > WINDOW:
                        raise ValueError(
                            f"audio of {waveform.numel() / 16000:.2f} s: long-form transcription (over 30 s) "
                            "is not supported yet; split the audio into windows of at most 30 s"
                        )
                    prompt = {"encoder_prompt": {"audio": waveform, "sampling_rate": 16000},
                              "decoder_prompt": {"prompt_token_ids": decoder}}
                    engine.add_request(rid, prompt, params, prompt_slot=slot)
                    requests[rid] = i
                except (AudioError, ValueError, TypeError) as e:
                    results[i] = Transcription(error=str(e))
            bar = _bar(len(requests), use_tqdm)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in requests:
                        results[requests[out.request_id]] = _result(out, prompts_info, decoder, language)
                        bar.update(1)
            bar.close()
        except BaseException:
            engine.abort_request([r for r, i in requests.items() if results[i] is None])
            raise
    return results  # type: ignore[return-value]


def _source(item: Any, sampling_rate: int | None) -> tuple[Any, int | None]:
    if isinstance(item, dict):
        unknown = set(item) - {"audio", "sampling_rate"}
        if "audio" not in item or unknown:
            raise ValueError(f"an audio input dict has 'audio' and 'sampling_rate', got keys {sorted(item)}")
        return item["audio"], item.get("sampling_rate", sampling_rate)
    if isinstance(item, (str, Path)):
        return item, None
    return item, sampling_rate


def _result(out, prompts: WhisperPrompts, decoder: list[int], language: str | None) -> Transcription:
    if out.error is not None:
        return Transcription(error=out.error)
    c = out.outputs[0]
    if language is None and prompts.multilingual:
        lang = prompts.language_code(out.prompt_token_ids[len(decoder)])
    elif language is not None and prompts.multilingual:
        lang = prompts.language_code(prompts.language_id(language))
    else:
        lang = "en"
    return Transcription(text=c.text.strip(), token_ids=list(c.token_ids), language=lang)


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Transcribing", disable=not enabled, unit="clip")
