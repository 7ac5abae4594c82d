"""The checkpoint's generation config as request defaults, read as HF ``generate`` reads it.

``load_generation_defaults`` turns ``generation_config.json`` (or, without one,
the legacy generation fields of ``config.json``, through
``GenerationConfig.from_model_config``) into a :class:`SamplingParams` of
defaults, HF's own global defaults filling what the file leaves unset
(``max_length`` 20 new tokens, ``top_k`` 50 when sampling, ...).
``merge_params`` lays a request's explicitly set fields over those defaults;
``resolve_lengths`` turns HF-style lengths into the request's token budget
once its decoder prompt is known.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tandem.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# HF generates this many new tokens when neither max_length nor max_new_tokens is set.
HF_DEFAULT_NEW_TOKENS = 20

# Generation settings tandem does not apply, with the value that means "off".
_UNSUPPORTED_OFF = {
    "encoder_repetition_penalty": (None, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "sequence_bias": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "renormalize_logits": (None, False),
    "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0.0),
    "constraints": (None,),
    "force_words_ids": (None,),
    "stop_strings": (None,),
    "max_time": (None,),
    "watermarking_config": (None,),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
}


@dataclass(frozen=True)
class GenerationDefaults:
    params: SamplingParams  # explicit_fields: what the checkpoint's config set
    eos_token_ids: tuple[int, ...] | None  # None: the config names none (use the model config's)
    source: str  # where the defaults came from
    ignored: tuple[str, ...] = ()  # settings in the config that tandem does not apply
    hf: object | None = None  # the transformers GenerationConfig (model-specific entries: Whisper's lang_to_id...)


def load_generation_defaults(model_dir: str, hf_config, mode: str = "auto") -> GenerationDefaults:
    """``mode``: "auto" (the checkpoint's), "none" (tandem's own SamplingParams
    defaults), or a directory holding a ``generation_config.json``."""
    if mode == "none":
        return GenerationDefaults(SamplingParams(), None, "tandem's SamplingParams defaults")
    from transformers import GenerationConfig

    folder = model_dir if mode == "auto" else mode
    if (Path(folder) / "generation_config.json").is_file():
        try:
            gen = GenerationConfig.from_pretrained(folder)
        except Exception as e:  # a malformed file is a bad checkpoint
            raise ValueError(f"{Path(folder) / 'generation_config.json'}: cannot be read as a generation config: {e}") from e
        source = str(Path(folder) / "generation_config.json")
    elif mode != "auto":
        raise ValueError(f"generation_config={mode!r}: no generation_config.json in that directory")
    else:
        gen = GenerationConfig.from_model_config(hf_config)
        source = "config.json (legacy generation fields)"
    return _from_hf(gen, source)


def _from_hf(gen, source: str) -> GenerationDefaults:
    def get(name, default=None):
        value = getattr(gen, name, None)
        return default if value is None else value

    kw: dict = {}
    num_beams = get("num_beams", 1)
    sample = bool(get("do_sample", False))
    if sample and num_beams > 1:
        logger.warning("%s: do_sample with num_beams=%d (beam sampling) is not supported; using beam search", source, num_beams)
        sample = False
    if sample:
        kw["temperature"] = float(get("temperature", 1.0))
        kw["top_k"] = int(get("top_k", 50))
        kw["top_p"] = float(get("top_p", 1.0))
        if gen.min_p is not None:
            kw["min_p"] = float(gen.min_p)
    else:
        kw["temperature"] = 0.0
    kw["num_beams"] = num_beams
    if num_beams > 1:
        kw["length_penalty"] = float(get("length_penalty", 1.0))
        kw["early_stopping"] = get("early_stopping", False)
    kw["n"] = get("num_return_sequences", 1)
    if gen.max_new_tokens is not None:
        kw["max_tokens"] = gen.max_new_tokens
    elif gen.max_length is not None:
        kw["max_tokens"], kw["max_length"] = None, gen.max_length
    else:
        kw["max_tokens"] = HF_DEFAULT_NEW_TOKENS
    if gen.min_new_tokens is not None:
        kw["min_tokens"] = gen.min_new_tokens
    if gen.min_length is not None:
        kw["min_length"] = gen.min_length
    for name in ("repetition_penalty", "no_repeat_ngram_size", "forced_bos_token_id", "forced_eos_token_id"):
        if getattr(gen, name, None) is not None:
            kw[name] = getattr(gen, name)
    for name in ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens"):
        if getattr(gen, name, None) is not None:
            kw[name] = getattr(gen, name)
    eos = gen.eos_token_id
    eos_ids = None if eos is None else tuple(eos if isinstance(eos, (list, tuple)) else [eos])
    ignored = tuple(
        f"{name}={getattr(gen, name)!r}"
        for name, off in _UNSUPPORTED_OFF.items()
        if getattr(gen, name, None) not in off
    )
    if ignored:
        logger.warning("%s: tandem does not apply these generation settings: %s", source, ", ".join(ignored))
    try:
        params = SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: a generation setting tandem cannot use: {e}") from e
    return GenerationDefaults(params, eos_ids, source, ignored, gen)


_SAMPLING_FILTERS = {"top_k": -1, "top_p": 1.0, "min_p": 0.0}


def merge_params(defaults: SamplingParams, request: SamplingParams, source: str = "the generation config") -> SamplingParams:
    """The request's explicitly set fields over the defaults (HF's rule: what the
    caller passes wins, the checkpoint's config fills the rest). Where an explicit
    field implies a decoding mode, the defaults of the other mode give way:
    an explicit ``temperature > 0`` (or explicit stop strings, or structured outputs) turns off beam search
    the caller did not ask for, and an explicit ``num_beams > 1`` turns off
    sampling the caller did not ask for. Raises ``ValueError`` for a
    combination beam search cannot serve, saying which values came from the defaults."""
    explicit = request.explicit_fields
    values = {name: getattr(defaults, name) for name in _field_names()}
    values.update({name: getattr(request, name) for name in explicit})
    if "num_beams" not in explicit and values["num_beams"] > 1:
        wants_sampling = "temperature" in explicit and not request.greedy
        wants_sampling |= any(name in explicit and getattr(request, name) != off for name, off in _SAMPLING_FILTERS.items())
        wants_sampling |= "structured_outputs" in explicit and request.structured_outputs is not None
        if wants_sampling or ("stop" in explicit and request.stop_strings):
            values["num_beams"] = 1
    if values["num_beams"] > 1:
        if "temperature" not in explicit:
            values["temperature"] = 0.0
        for name, off in _SAMPLING_FILTERS.items():
            if name not in explicit:
                values[name] = off
        if "n" not in explicit:
            values["n"] = min(values["n"], values["num_beams"])
    elif "n" not in explicit and not values["temperature"] and values["n"] > 1:
        values["n"] = 1  # num_return_sequences of a beam config means nothing for greedy decoding
    if "max_tokens" in explicit and "max_length" not in explicit:
        values["max_length"] = None  # HF: max_new_tokens takes precedence over max_length
    if "max_length" in explicit and "max_tokens" not in explicit:
        values["max_tokens"] = None
    if values["max_tokens"] is not None and values["min_tokens"] > values["max_tokens"] and "min_tokens" not in explicit:
        values["min_tokens"] = values["max_tokens"]
    from_defaults = sorted(set(values) - explicit - {"output_kind"})
    try:
        merged = SamplingParams.__new__(SamplingParams)
        object.__setattr__(merged, "_explicit", explicit)
        merged.__init__.__wrapped__(merged, **values)  # checks against the merged values below
        merged.check_beam_search()
    except (TypeError, ValueError) as e:
        conflicting = [f for f in from_defaults if f in str(e)]
        hint = f" ({', '.join(conflicting)} from {source}; pass them to override)" if conflicting else ""
        raise type(e)(f"{e}{hint}") from e
    return merged


def resolve_lengths(params: SamplingParams, prompt_len: int, positions_left: int) -> SamplingParams:
    """The request's ``max_tokens`` made concrete: the least of ``max_tokens``,
    ``max_length`` less the decoder prompt, and the decoder positions left.
    A limit the caller set that does not fit is a ``ValueError``; one from the
    defaults is capped, as HF caps its default length at the model's positions."""
    explicit = params.explicit_fields
    limits = []
    if params.max_length is not None:
        room = params.max_length - prompt_len
        if room < 1:
            raise ValueError(
                f"SamplingParams.max_length={params.max_length}: the decoder prompt already has {prompt_len} "
                "tokens, which leaves nothing to generate"
            )
        limits.append((room, "max_length" in explicit, f"max_length {params.max_length} - decoder prompt {prompt_len}"))
    if params.max_tokens is not None:
        limits.append((params.max_tokens, "max_tokens" in explicit, f"max_tokens ({params.max_tokens})"))
    if not limits:
        max_new = positions_left
    else:
        max_new, given, what = min(limits)
        if max_new > positions_left:
            if given:
                raise ValueError(
                    f"decoder prompt ({prompt_len} tokens) + {what} exceeds the model's "
                    f"{prompt_len + positions_left} decoder positions"
                )
            max_new = positions_left
    if max_new < 1:
        raise ValueError(f"the decoder prompt ({prompt_len} tokens) fills the model's decoder positions")
    if max_new == params.max_tokens:
        return params
    changes = {"max_tokens": max_new}
    if params.min_tokens > max_new:
        changes["min_tokens"] = max_new
    out = params.replace(**changes)
    object.__setattr__(out, "_explicit", explicit)  # resolved, not set by the caller
    return out


def _field_names() -> tuple[str, ...]:
    from tandem.core.sampling_params import _FIELD_NAMES

    return _FIELD_NAMES
