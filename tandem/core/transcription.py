"""The transcription interface: what a speech model class declares so that
``LLM.transcribe``, ``tandem transcribe`` and ``/v1/audio/*`` serve it.

A model class supports transcription when it implements
:class:`SupportsTranscription` (vLLM's ``SupportsTranscription`` is the
model: the class declares the capability, frontends ask
:func:`supports_transcription` and never import a model or audio code).

The work is split in two:

- the *driver*, in the frontend and the same for every model: it turns each
  input's raw audio into a waveform (:meth:`SupportsTranscription.load_transcription_audio`),
  submits one window request per input, collects each finished window's
  output and asks for the next, until every input is done;
- the *session*, from the model (:meth:`SupportsTranscription.transcription_session`):
  what each window's request is (encoder input through the model's own
  processor, decoder prompt, prompt slot, sampling params with the model's
  logits rules), how a finished window's output moves the input on (the
  long-form state machine), and the final :class:`Transcription`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from tandem.core.inputs import PromptSlot
    from tandem.core.outputs import RequestOutput
    from tandem.core.sampling_params import SamplingParams


@dataclass
class Transcription:
    """One input's transcript. ``error`` is set (and the rest empty) when the input
    could not be served; ``language`` is the language code (``"en"``), detected or given;
    ``segments`` (with timestamps): ``[{"start", "end", "text", "token_ids"}, ...]``, plus
    ``"no_speech_prob"`` (the window's) with ``no_speech_threshold`` and ``"words"`` with
    ``word_timestamps``; ``words`` (with ``word_timestamps``): ``[{"word", "start", "end"}, ...]``."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    language: str | None = None
    segments: list[dict] | None = None
    words: list[dict] | None = None
    error: str | None = None
    windows: int = 0  # window requests decoded, fallback re-decodes included


class AudioTooLongError(ValueError):
    """Audio longer than the ``max_seconds`` it was loaded with. A model's
    :meth:`SupportsTranscription.load_transcription_audio` raises it (or a subclass) so
    that a server can answer 413 without knowing the model's audio code."""

    def __init__(self, message: str, seconds: float, limit: float) -> None:
        super().__init__(message)
        self.seconds, self.limit = seconds, limit


@dataclass(frozen=True)
class TranscriptionOptions:
    """What a caller asks of one ``transcribe`` call. ``sampling``: other
    :class:`~tandem.core.sampling_params.SamplingParams` fields (``temperature`` may be
    a sequence: fallback temperatures). A session raises ``ValueError`` naming an
    option it cannot honour."""

    language: str | None = None
    task: str = "transcribe"
    timestamps: bool = False
    word_timestamps: bool = False  # each word's start and end (cross-attention alignment)
    condition_on_previous_text: bool = False
    compression_ratio_threshold: float | None = None
    logprob_threshold: float | None = None
    # A window whose no-speech probability is above it (and whose average log-probability
    # is below logprob_threshold, when given) is skipped as silence.
    no_speech_threshold: float | None = None
    prompt_ids: tuple[int, ...] = ()  # text tokens the first window is prompted with
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TranscriptionContext:
    """What a session may read from the engine it runs on. ``generation_config`` is the
    engine's transformers ``GenerationConfig`` (the one ``LLM(generation_config=...)``
    chose, None with ``"none"``): the same one ``generate`` builds default prompts from,
    so ``generate(audio)`` and ``transcribe`` agree."""

    hf_config: "PretrainedConfig"
    generation_config: Any
    tokenizer: Any
    # run_on_model(method, *args) -> the model's declared ``method(*args)`` (its
    # ``model_calls``), run between steps on every rank through the executor
    # (tandem/core/model_call.py: a failure comes back as a ValueError); None where the
    # caller cannot reach the engine between steps (options that need it fail).
    run_on_model: Any = None

    @classmethod
    def from_engine(cls, engine, run_on_model: Any = None) -> "TranscriptionContext":
        """The context of an ``LLMEngine``."""
        return cls(engine.hf_config, engine.generation_defaults.hf, engine.tokenizer, run_on_model)


@dataclass(frozen=True)
class WindowRequest:
    """One engine request: ``prompt`` goes to ``add_request`` with ``params`` and ``prompt_slot``."""

    prompt: Any
    params: "SamplingParams"
    prompt_slot: "PromptSlot | None" = None


@dataclass(frozen=True)
class WindowOutcome:
    """What a finished window did: whether its input is ``done``, and the ``segments``
    it finished (``{"start", "end", "text", "token_ids"}``; sent with a stream's delta;
    empty when the input has no segments to report before its result). ``text``: the
    input's transcript so far, when the model can say (a stream's delta is its new
    part, so the deltas join to the result's text); None: the server joins the
    segments' texts."""

    done: bool
    segments: list[dict] = field(default_factory=list)
    text: str | None = None


class TranscriptionSession(ABC):
    """One ``transcribe`` call's model-specific state machine. The driver calls, per
    input: :meth:`start` once, then :meth:`next_window` and (with the finished
    window's output) :meth:`take` until it says ``done``, then :meth:`result`.
    Inputs are independent: the driver interleaves them freely, one window in flight
    per input. ``ValueError`` / ``TypeError`` from a method fail that input alone."""

    @abstractmethod
    def start(self, waveform: "torch.Tensor") -> Any:
        """The per-input state for a waveform made by ``load_transcription_audio``."""

    @abstractmethod
    def next_window(self, state: Any) -> WindowRequest:
        """The request for the input's next window."""

    @abstractmethod
    def take(self, state: Any, output: "RequestOutput") -> WindowOutcome:
        """Digest the finished (error-free) output of the input's window in flight."""

    @abstractmethod
    def result(self, state: Any) -> Transcription:
        """The input's transcript, once :meth:`take` said ``done``."""


@runtime_checkable
class SupportsTranscription(Protocol):
    """The class-level interface of a model that transcribes audio. All methods are
    classmethods: frontends ask them before (or without) building the model."""

    supports_transcription: ClassVar[bool]  # True
    transcription_tasks: ClassVar[tuple[str, ...]]  # e.g. ("transcribe", "translate")
    transcription_sample_rate: ClassVar[int]  # samples per second of the waveforms it takes

    @classmethod
    def transcription_languages(cls, ctx: TranscriptionContext) -> tuple[str, ...]:
        """Language codes ``language=`` accepts on this checkpoint (``("en",)`` for an
        English-only one)."""
        ...

    @classmethod
    def transcription_window_seconds(cls, config: "PretrainedConfig") -> float:
        """Seconds of audio one window request covers."""
        ...

    @classmethod
    def check_audio_support(cls) -> None:
        """Raise ``ImportError`` naming what to install when this model's audio loading
        cannot run here (called before a model is loaded)."""
        ...

    @classmethod
    def load_transcription_audio(cls, source: Any, sampling_rate: int | None = None, *,
                                 max_seconds: float | None = None) -> "torch.Tensor":
        """Raw audio (a file path, a file's bytes, or samples with their
        ``sampling_rate``) as the 1-D waveform :meth:`TranscriptionSession.start` takes,
        at :attr:`transcription_sample_rate`. ``ValueError`` names what is wrong;
        :class:`AudioTooLongError` when over ``max_seconds``."""
        ...

    @classmethod
    def transcription_session(cls, ctx: TranscriptionContext, options: TranscriptionOptions) -> TranscriptionSession:
        """A session for one ``transcribe`` call; ``ValueError`` names an option this
        checkpoint cannot serve (an unknown language or task...)."""
        ...


def supports_transcription(model_cls: Any) -> bool:
    """Whether ``model_cls`` (a model class) declares :class:`SupportsTranscription`."""
    return getattr(model_cls, "supports_transcription", False) is True and isinstance(model_cls, SupportsTranscription)


def check_transcription(model_cls: Any, architecture: str) -> None:
    """Raise ``ValueError`` when ``model_cls`` does not transcribe, naming the architecture."""
    if not supports_transcription(model_cls):
        raise ValueError(
            f"{architecture} takes no audio: transcription needs a model class that supports it "
            "(tandem.core.transcription.SupportsTranscription), such as Whisper"
        )
