"""Request bodies of the OpenAI-compatible API (with vLLM's extra fields), and
their translation into tandem prompts and ``SamplingParams``."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from tandem.core.sampling_params import RequestOutputKind, SamplingParams
from tandem.core.structured_output.params import StructuredOutputsParams

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


class CompletionRequest(BaseModel):
    """``POST /v1/completions``. Only the fields a client sets reach
    ``SamplingParams``; the rest come from the checkpoint's generation config.

    Strict: a value of the wrong JSON type is a 400 naming the field, never
    coerced (``"max_tokens": "5"``, ``"stream": "yes"``, ``"n": true``, a float
    where an int is due). An int where a float is due is taken as that float."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: Union[str, list[int], list[str], list[list[int]], dict[str, Any], list[dict[str, Any]]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_repeat_ngram_size: int | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    bad_words_ids: list[list[int]] | None = None
    allowed_token_ids: list[int] | None = None
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

    _SAMPLING = (
        "max_tokens", "temperature", "top_p", "n", "seed", "logprobs", "presence_penalty", "frequency_penalty",
        "logit_bias", "top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids",
        "skip_special_tokens", "no_repeat_ngram_size", "num_beams", "length_penalty", "bad_words_ids",
        "allowed_token_ids", "stop",
    )

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo=true is not supported (encoder/decoder models do not continue their prompt)"
        if self.best_of not in (None, 1) and self.best_of != self.n:
            return f"best_of={self.best_of} is not supported; use n, or num_beams for beam search"
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
        given = {name: getattr(self, name) for name in self._SAMPLING if name in self.model_fields_set}
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
