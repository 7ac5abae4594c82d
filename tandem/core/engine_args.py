"""Engine options as ``LLM`` / ``AsyncLLM`` keywords and as command-line flags.

Everything here is generated from ``EngineConfig``'s fields (``tandem/core/config.py``), the
one declaration of each option: a new field is at once a keyword of both classes, a flag of
every command that builds an engine, and a line of ``help(LLM)``.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import types
import typing
from dataclasses import MISSING, Field, fields
from functools import cache
from typing import Any

from tandem.core.config import EngineConfig

GROUP_TITLE = "engine options"


@cache
def engine_options() -> tuple[Field, ...]:
    """``EngineConfig``'s fields but ``model`` (which every entry point takes its own way)."""
    return tuple(f for f in fields(EngineConfig) if f.name != "model")


def option_names() -> tuple[str, ...]:
    return tuple(f.name for f in engine_options())


def check_kwargs(owner: str, kwargs: dict[str, Any]) -> None:
    """A ``TypeError`` naming the first keyword that is no engine option, with close
    matches and the full list; the values themselves are ``EngineConfig``'s to check."""
    names = option_names()
    unknown = [k for k in kwargs if k not in names]
    if not unknown:
        return
    bad = unknown[0]
    close = difflib.get_close_matches(bad, names, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise TypeError(
        f"{owner}() got an unexpected keyword argument {bad!r}{hint} (engine options: {', '.join(names)})"
    )


@cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(EngineConfig)


def _cli_type(name: str):
    """The scalar type a flag parses to: ``int | None`` -> int, ``str | torch.dtype`` -> str."""
    hint = _hints()[name]
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in (bool, int, float, str):
        if t in members:
            return t
    raise TypeError(f"EngineConfig.{name}: {hint} has no command-line form (bool, int, float or str)")


def _flags(f: Field) -> tuple[str, ...]:
    return f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)


def _help(f: Field, cli: bool) -> str:
    """An option's help; another option written ```name``` becomes its flag on the command line."""
    by_name = {o.name: o for o in engine_options()}

    def ref(m: re.Match) -> str:
        other = by_name.get(m.group(1))
        if other is None:
            raise ValueError(f"EngineConfig.{f.name}'s help names `{m.group(1)}`, which is no engine option")
        return _flags(other)[0] if cli else m.group(1)

    return re.sub(r"`(\w+)`", ref, f.metadata["help"])


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every engine option as a flag, in an "engine options" group of ``parser``'s help,
    with the default and the choices the option declares."""
    group = parser.add_argument_group(GROUP_TITLE)
    for f in engine_options():
        kind = _cli_type(f.name)
        if kind is bool:
            if f.default is False:  # the flag turns it on
                group.add_argument(*_flags(f), dest=f.name, action="store_true", help=_help(f, cli=True))
            elif f.default is True:  # --flag / --no-flag (enforce_eager: on by default, vLLM's spelling)
                group.add_argument(*_flags(f), dest=f.name, action=argparse.BooleanOptionalAction, default=True,
                                   help=_help(f, cli=True))
            else:
                raise TypeError(f"EngineConfig.{f.name}: a bool option defaults to False or True, not {f.default!r}")
            continue
        metavar = None if f.metadata["choices"] else {int: "N", float: "X"}.get(kind, f.name.split("_")[-1].upper())
        group.add_argument(*_flags(f), dest=f.name, type=kind, default=f.default, choices=f.metadata["choices"],
                           metavar=metavar, help=_help(f, cli=True))
    return parser


def from_cli_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keywords ``add_cli_args`` parsed: ``LLM(model, **from_cli_args(args))``."""
    return {name: getattr(args, name) for name in option_names()}


def signature(*leading: inspect.Parameter) -> inspect.Signature:
    """``(self, model, <leading>, *, <each engine option with its default>)``: what
    ``help()`` and ``inspect.signature`` show for an ``__init__(self, model, **engine_args)``."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_hints()["model"]),
        *leading,
    ]
    for f in engine_options():
        default = f.default if f.default is not MISSING else inspect.Parameter.empty
        params.append(inspect.Parameter(f.name, kw, default=default, annotation=_hints()[f.name]))
    return inspect.Signature(params)


def describe_options() -> str:
    """The options for a docstring: one line each, name, choices, default and help."""
    lines = []
    for f in engine_options():
        text = _help(f, cli=False)
        choices = f" ({' | '.join(map(repr, f.metadata['choices']))})" if f.metadata["choices"] else ""
        default = "" if "(default:" in text else f" (default: {f.default!r})"
        lines.append(f"{f.name}{choices}: {text}{default}")
    return "\n".join(lines)
