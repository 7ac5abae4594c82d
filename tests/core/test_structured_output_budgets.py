"""Every grammar compile is bounded (issue 37): a spec over the size budget is refused
before compiling, naming its size and the limit; a compile past the time budget fails
its request naming the budget, and its thread (a daemon) holds nothing; a compile
whose waiter left before it started never runs; a schema nested too deep is a
``ValueError`` naming the field, never a bare ``RecursionError``.

A fake backend whose compile blocks until the test lets it go stands in for a slow
xgrammar compile, so nothing here depends on timing but the budget itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

from tandem import StructuredOutputsParams as SO
from tandem.core.strategies.structured.backend import GrammarCompileError
from tandem.core.strategies.structured.manager import StructuredOutputManager

WAIT = 30.0  # generous: each wait below ends in well under a second when the code is right


class BlockingBackend:
    def __init__(self) -> None:
        self.go = threading.Event()
        self.compiled: list = []

    def compile(self, so):
        self.go.wait(WAIT)
        self.compiled.append(so.spec)
        return ("compiled", so.spec)

    def matcher(self, compiled):
        return compiled


def _manager(**budgets) -> tuple[StructuredOutputManager, BlockingBackend]:
    m = StructuredOutputManager(None, 10, [0], max_workers=1, **budgets)
    m._backend = backend = BlockingBackend()
    return m, backend


def test_a_spec_over_the_size_budget_is_refused_before_compiling():
    m, backend = _manager(max_chars=100)
    future = m.grammar(SO(regex="a" * 101))
    with pytest.raises(GrammarCompileError, match=r"regex: 101 characters, over the grammar size budget of 100 "
                                                  r"\(engine option structured_outputs_max_chars\)"):
        future.result(timeout=0)
    backend.go.set()
    assert m.grammar(SO(regex="a" * 100)).result(timeout=WAIT) == ("compiled", "a" * 100)
    assert backend.compiled == ["a" * 100]
    m.shutdown()


def test_a_compile_past_the_time_budget_fails_naming_it_and_its_result_is_kept():
    m, backend = _manager(timeout=0.2)
    so = SO(regex="slow")
    with pytest.raises(GrammarCompileError, match=r"regex: did not compile within the grammar compile time budget "
                                                  r"of 0.2 s \(engine option structured_outputs_compile_timeout\)"):
        m.grammar(so).result(timeout=WAIT)
    worker = next(t for t in threading.enumerate() if t.name == "tandem-grammar")
    assert worker.daemon  # the interpreter's exit never waits for it
    again = m.grammar(so)  # joins the compile still under way instead of starting another
    backend.go.set()
    assert again.result(timeout=WAIT) == ("compiled", "slow")
    assert backend.compiled == ["slow"]
    assert m.grammar(so).result(timeout=0) == ("compiled", "slow")  # cached
    m.shutdown()


def test_a_compile_nobody_waits_for_is_cancelled_before_it_runs():
    m, backend = _manager()
    first = m.grammar(SO(regex="first"))  # holds the one worker
    left = SO(regex="left")
    future = m.grammar(left, may_release=True)
    m.release(left)  # its client left
    assert future.cancelled()
    kept = SO(regex="kept")
    shared = m.grammar(kept, may_release=True)
    engine_request = m.grammar(kept)  # an engine request waits for the same compile
    m.release(kept)
    assert not shared.cancelled()
    backend.go.set()
    assert first.result(timeout=WAIT) and engine_request.result(timeout=WAIT) == ("compiled", "kept")
    assert backend.compiled == ["first", "kept"]  # "left" never compiled
    m.shutdown()


def test_budgets_are_engine_options():
    from tandem.core.config import EngineConfig
    from tandem.core.engine_args import option_names

    assert {"structured_outputs_compile_timeout", "structured_outputs_max_chars"} <= set(option_names())
    for bad in ({"structured_outputs_compile_timeout": 0}, {"structured_outputs_max_chars": 0},
                {"structured_outputs_compile_timeout": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(model="x", **bad)


def _nested(depth: int) -> dict:
    d: dict = {}
    inner = d
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]
    return d


@pytest.mark.parametrize("schema", ["[" * 10_000 + "]" * 10_000, '{"a":' * 10_000 + "1" + "}" * 10_000,
                                    _nested(10_000)], ids=["array text", "object text", "dict"])
def test_a_schema_nested_10000_deep_is_a_value_error_naming_the_field(schema):
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.json=.*nests deeper than 128 levels"):
        SO(json=schema)


def test_a_schema_as_deep_as_allowed_is_taken():
    SO(json={"type": "object", "properties": _nested(60)})
