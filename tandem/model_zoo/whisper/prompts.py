"""Whisper's special tokens and the decoder prompts HF's ``generate`` builds from them."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.inputs import PromptSlot
from tandem.model_zoo.whisper.constants import TASKS


@dataclass(frozen=True)
class WhisperPrompts:
    """The special tokens of a Whisper checkpoint's generation config."""

    start: int
    lang_to_id: dict[str, int]  # "<|en|>" -> id
    task_to_id: dict[str, int]
    no_timestamps: int | None
    multilingual: bool
    eos: int
    prev_sot: int | None
    max_initial_timestamp_index: int | None

    @classmethod
    def from_generation_config(cls, gen, hf_config) -> "WhisperPrompts":
        """From the engine's transformers ``GenerationConfig`` (``LLM(generation_config=...)``);
        ``gen=None`` (``generation_config="none"``) is an error: the special tokens live there."""
        if gen is None:
            raise ValueError(
                "transcribe needs Whisper's special tokens (lang_to_id, task_to_id, no_timestamps_token_id) from a "
                "generation config, and this engine has none (generation_config='none'): use 'auto' (the "
                "checkpoint's generation_config.json) or a directory holding one"
            )
        start = gen.decoder_start_token_id if gen.decoder_start_token_id is not None else hf_config.decoder_start_token_id
        lang = dict(getattr(gen, "lang_to_id", None) or {})
        eos = gen.eos_token_id if gen.eos_token_id is not None else hf_config.eos_token_id
        return cls(
            int(start), lang, dict(getattr(gen, "task_to_id", None) or {}),
            getattr(gen, "no_timestamps_token_id", None),
            bool(getattr(gen, "is_multilingual", bool(lang))) and bool(lang),
            int(eos[0] if isinstance(eos, (list, tuple)) else eos),
            getattr(gen, "prev_sot_token_id", None),
            getattr(gen, "max_initial_timestamp_index", None),
        )

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    def languages(self) -> tuple[str, ...]:
        """The language codes of this checkpoint (``("en",)`` when English-only)."""
        if not self.multilingual:
            return ("en",)
        return tuple(t.strip("<|>") for t in self.lang_to_id)

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

    def language_position(self, prompt_ids: list[int]) -> int | None:
        """Where the language token sits in a (completed) decoder prompt, if it has one."""
        try:
            start = prompt_ids.index(self.start)
        except ValueError:
            return None
        nxt = start + 1
        return nxt if nxt < len(prompt_ids) and prompt_ids[nxt] in self.lang_to_id.values() else None

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

    def default_prompt(self, gen, hf_config) -> tuple[list[int], PromptSlot | None]:
        """The prompt HF ``generate`` builds for audio given no decoder prompt and no
        arguments (transformers' ``_retrieve_init_tokens``), from the generation config
        ``gen``: ``<|startoftranscript|>``; then its ``language`` and ``task``, or else
        its ``forced_decoder_ids`` (the model config's when it has none: openai's
        checkpoints force ``<|transcribe|>`` there); the language detected (a prompt
        slot) on multilingual checkpoints where none is set; a task token where a
        language is set; ``<|notimestamps|>`` last."""
        language, task = getattr(gen, "language", None), getattr(gen, "task", None)
        init: list[int | None] = [self.start]
        if language is None and task is None:
            forced = getattr(gen, "forced_decoder_ids", None) or getattr(hf_config, "forced_decoder_ids", None)
            if forced and forced[0][0] == 1:
                for position, (at, token) in enumerate(forced, start=1):
                    if at != position:
                        raise ValueError(
                            f"forced_decoder_ids={forced!r} (generation config): positions must run 1, 2, 3, ... "
                            "after <|startoftranscript|>, as Whisper's prompt does"
                        )
                    init.append(None if token is None else int(token))
        detect = False
        if language is not None:
            if len(init) > 1:
                init[1] = self.language_id(language)
            else:
                init.append(self.language_id(language))
        elif self.multilingual and (len(init) <= 1 or init[1] is None):
            detect = True
            if len(init) <= 1:
                init.append(None)
        task_ids = set(self.task_to_id.values())
        if task is not None:
            if task not in self.task_to_id:
                raise ValueError(f"task={task!r} (generation config): must be one of {', '.join(self.task_to_id)}")
            if task_ids & set(init):
                init = [self.task_to_id[task] if t in task_ids else t for t in init]
            else:
                init.append(self.task_to_id[task])
        elif language is not None and "transcribe" in self.task_to_id and not task_ids & set(init):
            init.append(self.task_to_id["transcribe"])
        # tandem's generate() decodes without timestamp rules, so the prompt says so too.
        if self.no_timestamps is not None and init[-1] != self.no_timestamps:
            init.append(self.no_timestamps)
        if detect:
            then = tuple(t for t in init[2:] if t is not None)
            return [self.start], PromptSlot(tuple(self.lang_to_id.values()), then)
        return [t for t in init if t is not None], None
