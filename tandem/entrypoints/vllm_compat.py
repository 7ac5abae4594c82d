"""vLLM's engine keywords and ``EngineArgs``, so vLLM's scripts run with the import changed.

tandem's own options stay declared once, in ``EngineConfig`` (``tandem/core/config.py``);
``EngineArgs`` is generated from its fields plus the few vLLM keywords that mean
something here (``VLLM_OPTIONS``). Each of those is either honoured, accepted because
it cannot change a result (documented in docs/from_vllm.md), or refused naming the
keyword and what tandem does instead. Any other vLLM keyword is refused by
``check_kwargs`` as every unknown keyword is.
"""

from __future__ import annotations

import argparse
import json
import secrets
from dataclasses import MISSING, asdict, dataclass, field, fields, make_dataclass
from typing import Any

from tandem.core.config import EngineConfig
from tandem.core.engine_args import GROUP_TITLE, add_cli_args
from tandem.core.vllm_prompts import MAX_AUDIO_PER_PROMPT

# name -> (default, what it means here). The default is "not given".
VLLM_OPTIONS: dict[str, tuple[Any, str]] = {
    "max_model_len": (None, "the model's decoder positions (prompt + output); the only value accepted is the "
                            "model's own limit (max_target_positions / max_position_embeddings)"),
    "limit_mm_per_prompt": (None, "{'audio': 0 or 1} (image and video 0): one encoder input per prompt"),
    "gpu_memory_utilization": (None, "accepted, no effect on results: the KV pool is sized by kv_cache_memory "
                                     "(GiB) or num_kv_blocks"),
}


@dataclass
class VllmOptions:
    """The vLLM keywords given to one ``LLM``; ``check_engine`` checks those that need the model."""

    max_model_len: int | None = None

    def check_engine(self, engine) -> None:
        limit = engine.model_cls.max_decoder_len(engine.hf_config)
        n = self.max_model_len
        if n is None or n == limit:
            return
        if n > limit:
            raise ValueError(f"max_model_len={n} is more than the model's {limit} decoder positions")
        raise ValueError(
            f"max_model_len={n} is less than the model's {limit} decoder positions: tandem does not shorten the "
            f"model's limit; cap each request's output with SamplingParams(max_tokens=...), or pass "
            f"max_model_len={limit} or None"
        )


def split_vllm_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], VllmOptions]:
    """tandem's engine keywords, and the vLLM ones checked (those that need the model
    are checked by ``VllmOptions.check_engine`` once it is loaded)."""
    kwargs = dict(kwargs)
    given = {name: kwargs.pop(name) for name in VLLM_OPTIONS if name in kwargs}
    if "seed" in kwargs and kwargs["seed"] is None:
        # vLLM's seed=None: not reproducible. A fresh seed says the same, where dropping it would mean 0.
        kwargs["seed"] = secrets.randbits(63)
    n = given.get("max_model_len")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"max_model_len={n!r}: must be None or an integer >= 1")
    _check_mm_limits(given.get("limit_mm_per_prompt"))
    g = given.get("gpu_memory_utilization")
    if g is not None and (not isinstance(g, (int, float)) or isinstance(g, bool) or not 0 < g <= 1):
        raise ValueError(f"gpu_memory_utilization={g!r}: must be None or a fraction in (0, 1]")
    return kwargs, VllmOptions(max_model_len=n)


def _check_mm_limits(limits: Any) -> None:
    if limits is None:
        return
    if not isinstance(limits, dict):
        raise TypeError(f"limit_mm_per_prompt={limits!r}: must be a dict such as {{'audio': 1}}")
    for modality, count in limits.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}]={count!r}: must be an integer >= 0")
        if modality == "audio" and count > MAX_AUDIO_PER_PROMPT:
            raise ValueError(
                f"limit_mm_per_prompt={{'audio': {count}}}: an encoder/decoder model takes {MAX_AUDIO_PER_PROMPT} "
                "audio per prompt (its encoder input); give each audio its own prompt"
            )
        if modality != "audio" and count > 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}]={count}: only audio is served (no {modality} models)")


def _engine_args_fields() -> list[tuple]:
    out = []
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else MISSING
        out.append((f.name, f.type, field(default=default, metadata=f.metadata)))
    for name, (default, help) in VLLM_OPTIONS.items():
        out.append((name, Any, field(default=default, metadata={"help": help})))
    return out


def _create_engine_config(self) -> EngineConfig:
    """The ``EngineConfig`` these arguments build (the vLLM keywords checked first)."""
    engine_kwargs, _ = split_vllm_options({k: v for k, v in asdict(self).items() if k != "model"})
    return EngineConfig(model=self.model, **engine_kwargs)


# The vLLM keywords' flags, as vLLM spells them (``--limit-mm-per-prompt '{"audio": 1}'``).
_VLLM_FLAG_TYPES = {"max_model_len": int, "kv_cache_dtype": str, "gpu_memory_utilization": float}


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object such as '{{\"audio\": 1}}'")
    return value


def _add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """vLLM's ``EngineArgs.add_cli_args(parser)``: ``--model``, every engine option's flag
    (``tandem.core.engine_args``) and the vLLM keywords' flags. ``vars(parser.parse_args())``
    are ``LLM`` keywords; ``EngineArgs.from_cli_args(args)`` makes an ``EngineArgs``."""
    parser.add_argument("--model", default=None, help="local checkpoint directory or Hugging Face Hub repo id")
    add_cli_args(parser)
    group = next(g for g in parser._action_groups if g.title == GROUP_TITLE)
    for name, (default, help) in VLLM_OPTIONS.items():
        kind = _json_dict if name == "limit_mm_per_prompt" else _VLLM_FLAG_TYPES[name]
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=default,
                           help=help.replace("`dtype`", "--dtype"))
    return parser


def _from_cli_args(cls, args: argparse.Namespace):
    """vLLM's ``EngineArgs.from_cli_args(args)``: the ``EngineArgs`` that ``add_cli_args``'s flags parsed."""
    if getattr(args, "model", None) is None:
        raise ValueError("EngineArgs.from_cli_args: no model: pass --model (or parser.set_defaults(model=...))")
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


# vLLM's ``EngineArgs``: ``LLM(**dataclasses.asdict(EngineArgs(model=..., ...)))``.
EngineArgs = make_dataclass(
    "EngineArgs",
    _engine_args_fields(),
    namespace={
        "__module__": __name__,
        "__doc__": "Engine options as vLLM's ``EngineArgs``: every ``EngineConfig`` field plus vLLM's keywords "
                   "(``VLLM_OPTIONS``); values are checked when an engine is built from them.",
        "create_engine_config": _create_engine_config,
        "add_cli_args": staticmethod(_add_cli_args),
        "from_cli_args": classmethod(_from_cli_args),
    },
)
