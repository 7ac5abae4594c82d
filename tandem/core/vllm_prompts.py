"""vLLM's prompt shapes, rewritten into tandem's before input processing.

vLLM gives audio to an encoder/decoder model as ``multi_modal_data``:

- ``{"prompt": "<|startoftranscript|>", "multi_modal_data": {"audio": (array, sr)}}``:
  the audio is the encoder input and the prompt text (or ``prompt_token_ids``) the
  decoder prompt (vLLM's convention for Whisper);
- ``{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": ...}},
  "decoder_prompt": ...}``: the same, spelt out.

The audio value is ``(samples, sampling_rate)``, a list holding one such pair, or bare
samples. ``mm_processor_kwargs`` (which ``zip_enc_dec_prompts`` adds, empty) is accepted
when empty. Anything else vLLM-shaped is refused naming the key, never dropped.
"""

from __future__ import annotations

from typing import Any

# Audio items one prompt may carry: an encoder/decoder model here has one encoder input.
MAX_AUDIO_PER_PROMPT = 1


def normalize_prompt(prompt: Any) -> Any:
    """``prompt`` in tandem's shapes (``tandem.core.inputs``); other prompts unchanged."""
    if not isinstance(prompt, dict):
        return prompt
    if "encoder_prompt" in prompt:
        _check_mm_kwargs(prompt, "prompt")
        encoder = _encoder_side(prompt["encoder_prompt"])
        decoder = prompt.get("decoder_prompt")
        if isinstance(decoder, dict):
            _check_mm_kwargs(decoder, "decoder_prompt")
            if "multi_modal_data" in decoder:
                raise ValueError("decoder_prompt has multi_modal_data: audio goes in the encoder prompt")
            decoder = _without_mm_kwargs(decoder)
        rest = {k: v for k, v in prompt.items() if k not in ("encoder_prompt", "decoder_prompt", "mm_processor_kwargs")}
        return {**rest, "encoder_prompt": encoder, "decoder_prompt": decoder}
    if "audio" in prompt:
        audio, rate = _audio_value(prompt["audio"], "audio")
        if rate is not None and prompt.get("sampling_rate") is None:
            return {**prompt, "audio": audio, "sampling_rate": rate}
        return prompt
    _check_mm_kwargs(prompt, "prompt")
    if "multi_modal_data" not in prompt:
        return _without_mm_kwargs(prompt)
    # A singleton with audio: the audio is the encoder's, the text the decoder's.
    audio = _audio_prompt(prompt["multi_modal_data"], "prompt")
    decoder = {k: v for k, v in prompt.items() if k not in ("multi_modal_data", "mm_processor_kwargs")}
    if not decoder or decoder == {"prompt": ""}:
        return audio  # no decoder prompt: the model's default
    return {"encoder_prompt": audio, "decoder_prompt": decoder}


def _encoder_side(encoder: Any) -> Any:
    if not isinstance(encoder, dict) or "multi_modal_data" not in encoder:
        return _without_mm_kwargs(normalize_prompt(encoder)) if isinstance(encoder, dict) else encoder
    _check_mm_kwargs(encoder, "encoder_prompt")
    text = encoder.get("prompt", "")
    if text != "" or encoder.get("prompt_token_ids"):
        raise ValueError(
            f"encoder_prompt has multi_modal_data and text {text!r} or token ids: an audio model's encoder takes "
            "the audio alone; put the text in decoder_prompt"
        )
    unknown = set(encoder) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} in encoder_prompt")
    return _audio_prompt(encoder["multi_modal_data"], "encoder_prompt")


def _audio_prompt(mm: Any, where: str) -> dict:
    if not isinstance(mm, dict):
        raise TypeError(f"{where}.multi_modal_data must be a dict such as {{'audio': (samples, rate)}}, "
                        f"got {type(mm).__name__}")
    other = sorted(set(mm) - {"audio"})
    if other:
        raise ValueError(f"{where}.multi_modal_data has {other}: only 'audio' is served (no image or video models)")
    if "audio" not in mm:
        raise ValueError(f"{where}.multi_modal_data has no 'audio'")
    audio, rate = _audio_value(mm["audio"], f"{where}.multi_modal_data['audio']")
    return {"audio": audio} if rate is None else {"audio": audio, "sampling_rate": rate}


def _audio_value(value: Any, where: str) -> tuple[Any, int | None]:
    """``(samples, rate)``, ``[(samples, rate)]`` or samples -> (samples, rate or None)."""
    if isinstance(value, list) and value and all(_is_pair(v) or hasattr(v, "shape") for v in value):
        if len(value) > MAX_AUDIO_PER_PROMPT:
            raise ValueError(
                f"{where} has {len(value)} audio items: an encoder/decoder model takes {MAX_AUDIO_PER_PROMPT} per "
                "prompt (limit_mm_per_prompt={'audio': 1}); give each its own prompt"
            )
        value = value[0]
    if _is_pair(value):
        samples, rate = value
        return samples, int(rate)
    return value, None


def _is_pair(value: Any) -> bool:
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float))
            and not isinstance(value[1], bool) and not isinstance(value[0], (int, float)))


def _check_mm_kwargs(prompt: dict, where: str) -> None:
    kwargs = prompt.get("mm_processor_kwargs")
    if kwargs:  # changing the audio processor per request is not built: refuse rather than ignore
        raise ValueError(f"{where}.mm_processor_kwargs={kwargs!r}: per-request processor options are not supported; "
                         "leave it empty")


def _without_mm_kwargs(prompt: dict) -> dict:
    return {k: v for k, v in prompt.items() if k != "mm_processor_kwargs"} if "mm_processor_kwargs" in prompt else prompt
