"""``SamplingParams``' fields as the entry points show them, generated from each field's
metadata (``param`` in ``tandem/core/sampling_params.py``): the server's request fields, the
``tandem generate`` flags and docs/generation.md's "Request fields" table. A new field with
``api=`` / ``cli=`` appears in all three by itself.

``python -m tandem.entrypoints.sampling_options`` prints the table (tests/docs/test_docs.py
checks the docs hold it as printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import types
import typing
from dataclasses import Field

from tandem.core.sampling_params import SamplingParams

GROUP_TITLE = "sampling options"


def api_fields() -> dict[str, Field]:
    """The request field name (OpenAI's spelling) -> the ``SamplingParams`` field it sets."""
    return {f.metadata["api_name"] or f.name: f for f in dataclasses.fields(SamplingParams)
            if f.metadata.get("api") is not None}


def cli_fields() -> dict[str, Field]:
    """The flag -> the ``SamplingParams`` field it sets."""
    return {_flag(f): f for f in dataclasses.fields(SamplingParams) if f.metadata.get("cli")}


def _flag(f: Field) -> str:
    cli = f.metadata["cli"]
    return cli if isinstance(cli, str) else "--" + f.name.replace("_", "-")


def _dest(f: Field) -> str:
    return _flag(f).removeprefix("--").replace("-", "_")


def _members(api: object) -> tuple:
    return typing.get_args(api) if isinstance(api, types.UnionType) else (api,)


def _json_or_text(api: object):
    """A flag's parser for a JSON-valued field (lists, objects); where the field also takes a
    string, text that is no JSON is that string (``--stop .``)."""
    takes_text = str in _members(api)

    def parse(text: str):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            if takes_text:
                return text
            raise argparse.ArgumentTypeError(f"must be JSON, got {text!r} ({e})") from None

    parse.__name__ = "JSON"  # argparse names the type in its error
    return parse


def add_sampling_args(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """A flag for each ``cli`` field (or the fields named in ``only``), each defaulting to None:
    a request sets only what was given, the rest comes from the generation config."""
    group = parser.add_argument_group(GROUP_TITLE)
    for f in dataclasses.fields(SamplingParams):
        if not f.metadata.get("cli") or (only is not None and f.name not in only):
            continue
        api = f.metadata["api"]
        default = "none" if f.default is None else repr(f.default)
        text = f"{f.metadata['help']} (default: the generation config's, else {default}; SamplingParams.{f.name})"
        if api is bool:
            group.add_argument(_flag(f), dest=_dest(f), action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        elif api in (int, float, str):
            group.add_argument(_flag(f), dest=_dest(f), type=api, default=None, help=text)
        else:
            group.add_argument(_flag(f), dest=_dest(f), type=_json_or_text(api), default=None, metavar="JSON",
                                help=text)


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The ``SamplingParams`` keywords of the sampling flags that were given."""
    given = {f.name: getattr(args, _dest(f), None) for f in cli_fields().values()}
    return {k: v for k, v in given.items() if v is not None}


def markdown_table() -> str:
    """docs/generation.md's "Request fields" table: every field, where it can be set."""
    rows = ["| `SamplingParams` field | default | server (`/v1/completions`) | `tandem generate` | what |",
            "|---|---|---|---|---|"]
    for f in dataclasses.fields(SamplingParams):
        if not f.init:
            continue
        api = f.metadata.get("api")
        server = f"`{f.metadata['api_name'] or f.name}`" if api is not None else "-"
        flag = f"`{_flag(f)}`" if f.metadata.get("cli") else "-"
        default = f"{type(f.default).__name__}.{f.default.name}" if isinstance(f.default, enum.Enum) else repr(f.default)
        rows.append(f"| `{f.name}` | `{default}` | {server} | {flag} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
