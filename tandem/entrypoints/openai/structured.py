"""Structured output in the OpenAI-compatible API: OpenAI's ``response_format``
(``json_object``, ``json_schema``) and vLLM's extra fields (``structured_outputs``,
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``), read
into one ``StructuredOutputsParams``; and its compile, awaited before the request
is queued, so a spec that does not compile is a 400 naming the field it came in.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tandem.core.structured_params import StructuredOutputsParams
from tandem.entrypoints.openai.protocol import HTTPError
from tandem.entrypoints.openai.shutdown import watch


# vLLM's guided_* fields and the StructuredOutputsParams field each fills.
GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
          ("guided_grammar", "grammar"))


@dataclass(frozen=True)
class StructuredRequest:
    params: StructuredOutputsParams
    field: str  # the request field it came in, for errors


def read_structured(req) -> StructuredRequest | None:
    """The request's structured output (None when it asks for none). Raises
    ``HTTPError`` 400 naming the field: more than one kind, or a spec
    ``StructuredOutputsParams`` refuses."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        if fmt.type != "json_schema" and fmt.json_schema is not None:
            raise _bad("response_format.json_schema", f"is only taken with type 'json_schema', not {fmt.type!r}")
        if fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise _bad("response_format.json_schema.schema", "a JSON schema is required with type 'json_schema'")
            given.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    for name, kind in GUIDED:
        value = getattr(req, name)
        if value is not None:
            given.append((name, {kind: value}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs.kwargs()))
    if not given:
        return None
    if len(given) > 1:
        names = [g[0] for g in given]
        raise HTTPError(400, f"{', '.join(names[:-1])} and {names[-1]} each ask for a structured output: give one "
                             "per request", param=names[1])
    field, kwargs = given[0]
    try:
        return StructuredRequest(StructuredOutputsParams(**kwargs), field)
    except (ValueError, TypeError) as e:
        raise _bad(field, str(e)) from None
    except RecursionError:  # a value nested past what parsing it can recurse (params bound schemas first)
        raise _bad(field, "nests too deep to parse") from None


async def check_compiles(engine, so: StructuredRequest, cut: asyncio.Event, request=None) -> None:
    """Wait for ``so``'s compile (cached: the request that follows reuses it). A spec
    that does not compile, is over the size budget or misses the time budget is a 400
    naming the field and the cause; a server without xgrammar answers 501 naming the
    extra to install; the drain cut, 503. A client that leaves (``request``: the
    Starlette request, watched for a disconnect) stops the wait, which cancels a
    compile nobody else waits for (the answer, 499, goes nowhere)."""
    compiling = asyncio.ensure_future(engine.compile_structured_outputs(so.params))
    try:
        outcome = await watch([compiling], request, cut)
        if outcome == "cut":
            raise HTTPError(503, cut.message)
        if outcome == "disconnected":
            raise HTTPError(499, "client disconnected")
        compiling.result()
    except ImportError as e:
        raise HTTPError(501, f"{so.field}: {e}", param=so.field) from None
    except (ValueError, TypeError) as e:
        raise HTTPError(400, f"{so.field}: {e}", param=so.field) from None
    finally:
        if not compiling.done():  # releases the compile: cancelled unless started or wanted by another
            compiling.cancel()


def _bad(field: str, why: str) -> HTTPError:
    return HTTPError(400, f"{field}: {why}", param=field)
