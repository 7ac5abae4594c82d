"""Request bodies of the OpenAI-compatible API (with vLLM's extra fields), and
their translation into tandem prompts and ``SamplingParams``."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from tandem.core.param_errors import shown
from tandem.core.sampling_params import RequestOutputKind, SamplingParams
from tandem.core.structured_params import StructuredOutputsParams
from tandem.core.text_checks import check_unicode
from tandem.entrypoints.sampling_options import api_fields

PromptItem = Union[str, list[int], dict[str, Any]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``. ``strict`` is taken and changes nothing: the
    output always follows the schema."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # BaseModel has a .schema()
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` object: ``StructuredOutputsParams`` field for field."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # BaseModel has a .json()
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def kwargs(self) -> dict[str, Any]:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object, "disable_any_whitespace": self.disable_any_whitespace}
        return {k: v for k, v in given.items() if v is not None}


class _OwnFields(BaseModel):
    """``POST /v1/completions``'s fields that are no ``SamplingParams`` field; ``CompletionRequest``
    (below) is made of these and the sampling fields generated from ``SamplingParams``' metadata."""

    model: str | None = None
    prompt: Union[str, list[int], list[str], list[list[int]], dict[str, Any], list[dict[str, Any]]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # Structured output (structured.py reads these; at most one per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Echoed as the response's id and logged; the engine's request ids are the
    # server's own, so one client's id never meets another's.
    request_id: str | None = Field(default=None, max_length=256, description="optional id, echoed in the response")


class _CompletionRequestBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo=true is not supported (encoder/decoder models do not continue their prompt)"
        if self.best_of is not None:
            n = 1 if self.n is None else self.n
            if self.best_of < n:  # OpenAI's rule: n completions are chosen among best_of
                return f"best_of={self.best_of} must be >= n={n}: n completions are returned out of best_of"
            if self.best_of != n:
                return f"best_of={self.best_of} with n={n} is not supported (only best_of == n); use n, or num_beams " \
                       "for beam search"
        if self.suffix:
            return "suffix is not supported"
        return None

    def prompts(self) -> list[Any]:
        """Each prompt as tandem takes it: text, ``{"prompt_token_ids": [...]}``, or an
        encoder/decoder dict (vLLM's form). Audio in them is still the client's JSON
        (inline data, or a string the server refuses): ``media.py`` decodes it."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p, dict):
            items = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise ValueError("prompt is empty: give a string, token ids, or a list of them")
        return [{"prompt_token_ids": x} if isinstance(x, list) else x for x in items]

    def sampling_params(self, structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """``structured_outputs``: what ``structured.read_structured`` made of this request."""
        given = {f.name: getattr(self, name) for name, f in SAMPLING_FIELDS.items() if name in self.model_fields_set}
        given = {k: v for k, v in given.items() if v is not None}
        if "logit_bias" in given:
            try:
                given["logit_bias"] = {int(k): float(v) for k, v in given["logit_bias"].items()}
            except ValueError as e:
                raise ValueError(f"logit_bias keys must be token ids: {e}") from e
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        if structured_outputs is not None:
            given["structured_outputs"] = structured_outputs
        return SamplingParams(**given, output_kind=kind)


# Every SamplingParams field whose metadata gives it an ``api`` type: request name -> field.
SAMPLING_FIELDS = api_fields()
# OpenAI's completions fields in its reference's order, then the other sampling fields (vLLM's and
# tandem's, in SamplingParams' order), then the rest: a request's problems are named in this order.
_OPENAI_ORDER = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                 "seed", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user", "echo", "best_of",
                 "suffix")
_ALL_FIELDS = {
    **{name: (info.annotation, info) for name, info in _OwnFields.model_fields.items()},
    **{name: (f.metadata["api"] | None, Field(default=None, description=f.metadata["help"]))
       for name, f in SAMPLING_FIELDS.items()},
}

CompletionRequest = create_model(
    "CompletionRequest",
    __base__=_CompletionRequestBase,
    __module__=__name__,
    __doc__="""``POST /v1/completions``. Only the fields a client sets reach
    ``SamplingParams``; the rest come from the checkpoint's generation config.

    Strict: a value of the wrong JSON type is a 400 naming the field, never
    coerced (``"max_tokens": "5"``, ``"stream": "yes"``, ``"n": true``, a float
    where an int is due). An int where a float is due is taken as that float.""",
    **{name: _ALL_FIELDS[name] for name in dict.fromkeys([*_OPENAI_ORDER, *SAMPLING_FIELDS, *_ALL_FIELDS])},
)


# A request-validation error names at most this many problems, then counts the rest: 200,000
# unknown fields made a 9.7 MB answer, and the first few are what a client fixes first.
MAX_SHOWN_PROBLEMS = 20
MAX_SHOWN_CHARS = 200  # of a field's path, a message or a value, each


def validation_message(errors: list[dict], body: bytes | None = None) -> str:
    """One message for pydantic's ``errors``, each problem naming its field (or the body): the
    first ``MAX_SHOWN_PROBLEMS``, each part cut to ``MAX_SHOWN_CHARS``, and how many more there
    are. ``body``: the raw request, to name the field of a lone surrogate that the JSON parser
    refused with only a line and column."""
    parts = []
    for e in errors[:MAX_SHOWN_PROBLEMS]:
        if e.get("type") == "json_invalid":  # the message says where: "... at line 1 column 15"
            why = (e.get("ctx") or {}).get("error") or e.get("msg", "")
            escape = "surrogate" in why or "hex escape" in why
            surrogate = _lone_surrogate(body) if escape and body is not None else None
            parts.append(surrogate or f"invalid JSON body: {_cut(why)}")
            continue
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if not where and e.get("type") == "model_type":
            parts.append(f"the body must be a JSON object (got {type(e.get('input')).__name__})")
            continue
        got = f" (got {shown(e['input'], MAX_SHOWN_CHARS)})" if "input" in e else ""
        parts.append(f"{_cut(where) or 'body'}: {_cut(str(e.get('msg')))}{got}")
    more = len(errors) - MAX_SHOWN_PROBLEMS
    if more > 0:
        parts.append(f"and {more} more problem{'s' if more > 1 else ''} (the first {MAX_SHOWN_PROBLEMS} are shown)")
    return "; ".join(parts) or "invalid request body"


def _cut(text: str) -> str:
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def _lone_surrogate(body: bytes) -> str | None:
    """The field and position of the first lone surrogate escape (``"\\ud800"``) in JSON ``body``,
    as ``check_unicode`` names it; None when ``body`` is not JSON to Python's parser either
    (which, unlike the request parser, decodes such escapes). The walk is iterative: no depth
    of nesting can recurse."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                here = f"{path}.{key}" if path else str(key)
                try:
                    check_unicode(key, f"the key {shown(here, MAX_SHOWN_CHARS)}")
                except ValueError as e:
                    return str(e)
                todo.append((here, sub))
        elif isinstance(item, list):
            todo.extend((f"{path}[{i}]", sub) for i, sub in reversed(list(enumerate(item))))
        elif isinstance(item, str):
            try:
                check_unicode(item, _cut(path) or "body")
            except ValueError as e:
                return str(e)
    return None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind: Literal["invalid_request_error", "authentication_error", "server_error", "overloaded_error"]
    kind = {401: "authentication_error", 503: "overloaded_error"}.get(status, "invalid_request_error")
    if status >= 500 and status != 503:
        kind = "server_error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


class HTTPError(Exception):
    """An error answer: its status, message (OpenAI's shape, ``error_body``), headers
    and the request field at fault (``param``), where one is."""

    def __init__(self, status: int, message: str, headers: dict | None = None, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers, self.param = status, message, headers or {}, param
