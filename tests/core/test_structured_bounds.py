"""The grammar cost bounds (``bounds.py``), the jump-forward search's CPU budget
(``jump.JumpSearch``) and the check of a finished JSON output (``validate.py``),
each alone. The engine-level cases are in tests/entrypoints/test_structured_hardening.py."""

from __future__ import annotations

import json
import time

import pytest

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

from tandem.core.schema_check import ENFORCED_FORMATS  # noqa: E402
from tandem.core.strategies.structured.bounds import GrammarBoundsError, check_bounds  # noqa: E402
from tandem.core.strategies.structured.jump import JumpBudgetError, JumpSearch  # noqa: E402
from tandem.core.strategies.structured.validate import OutputChecker  # noqa: E402


def regex_grammar(pattern: str) -> str:
    return str(xgr.Grammar.from_regex(pattern))


def check(kind: str, spec, max_repeat: int = 10_000, **kw):
    if kind == "regex":
        g = xgr.Grammar.from_regex(spec)
    elif kind == "json":
        g = xgr.Grammar.from_json_schema(json.dumps(spec), **kw)
    else:
        g = xgr.Grammar.from_ebnf(spec)
    return check_bounds(str(g), max_repeat, regex_grammar)


@pytest.mark.parametrize("kind, spec", [
    ("regex", r"[a-c]+(ab|cd)*x{2,5}"), ("regex", r"\d{3}-\w+"), ("regex", "x{10000}"), ("regex", "(a?){128}"),
    ("regex", "a{0,10000}"), ("grammar", 'root ::= "(" root ")" | "a"'), ("grammar", 'root ::= "a\\"b" | [\\[\\]]*'),
    ("grammar", 'root ::= a b\na ::= "x"?\nb ::= "y"*'), ("grammar", 'root ::= ("x"{100}){100}'),
    ("json", {"type": "object"}),
    ("json", {"type": "string", "maxLength": 10000}),
    ("json", {"type": "object", "patternProperties": {"^a[0-9]+$": {"type": "integer"}},
              "additionalProperties": False, "minProperties": 1, "maxProperties": 3}),
    ("json", {"type": "object", "propertyNames": {"pattern": '^[a-z"\\\\]+$'}}),
    ("json", {"$defs": {"n": {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}),
] + [("json", {"type": "string", "format": f}) for f in sorted(ENFORCED_FORMATS)])
def test_grammars_within_the_bounds_pass(kind, spec):
    check(kind, spec)
    if kind == "json":
        check(kind, spec, any_whitespace=False)


@pytest.mark.parametrize("kind, spec, says", [
    ("regex", "x{2147483647}", "a repetition count of 2147483647 (in rule 'root'), over the limit of 10000 (engine "
                               "option structured_outputs_max_repeat)"),
    ("regex", "x{3,}y{10001,}", "a repetition count of 10001"),
    ("regex", "(a?){129}", "an element that can match nothing repeated up to 129 times (in rule 'root'), over the limit "
                           "of 128: repeat something that cannot be empty (write (a?){n} as a{0,n})"),
    ("grammar", 'root ::= "x" root', "rule 'root' can never end: every way through it leads back into it"),
    ("grammar", 'root ::= "a" | "b" loop\nloop ::= "x" loop', "rule 'loop' can never end"),
    ("grammar", 'root ::= ("x"{100}){101}', "rule 'root' matches no text shorter than 10100 characters, over the "
                                             "limit of 10000"),
    ("grammar", 'root ::= TagDispatch(("<a>", r))\nr ::= "x"', "could not be checked for its cost (the construct "
                                                               "TagDispatch(...)), so it is not compiled"),
    ("json", {"type": "string", "minLength": 20000}, "a repetition count of 20000"),
    # xgrammar takes ~30 s of CPU to compile this schema: the default run checks the same
    # pattern-property path under a lower limit (test_a_pattern_property_over_the_limit_given_is_refused).
    pytest.param("json", {"type": "object", "patternProperties": {"^a{20000}$": {"type": "integer"}},
                          "additionalProperties": False}, "a repetition count of 20000", marks=pytest.mark.slow),
    ("json", {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
              "$ref": "#/$defs/a"}, "rule 'defs_a' can never end"),
])
def test_grammars_over_a_bound_are_refused_naming_it(kind, spec, says):
    with pytest.raises(GrammarBoundsError) as e:
        check(kind, spec)
    assert says in str(e.value)


def test_a_pattern_property_over_the_limit_given_is_refused():
    """A patternProperties key's regex is checked against the caller's limit, as the slow
    20000-over-10000 case above is against the default one."""
    spec = {"type": "object", "patternProperties": {"^a{200}$": {"type": "integer"}}, "additionalProperties": False}
    with pytest.raises(GrammarBoundsError) as e:
        check("json", spec, max_repeat=100)
    assert "a repetition count of 200 (in rule 'root'), over the limit of 100" in str(e.value)
    check("json", spec, max_repeat=300)  # over the count and the shortest object (206 characters): passes


def test_the_limit_is_the_callers():
    check("regex", "x{5}", max_repeat=5)
    with pytest.raises(GrammarBoundsError, match="a repetition count of 6 .* over the limit of 5"):
        check("regex", "x{6}", max_repeat=5)
    with pytest.raises(GrammarBoundsError, match="no text shorter than 9 characters, over the limit of 5"):
        check("grammar", 'root ::= ("x"{3}){3}', max_repeat=5)


class Spinning:
    """A matcher whose search spins on the CPU for ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def find_jump_forward_string(self) -> str:
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass
        return "x"


def test_a_search_past_its_cpu_budget_fails_and_is_abandoned():
    search = JumpSearch(budget=0.05)
    assert search.forced(Spinning(0.0)) == "x"
    t0 = time.monotonic()
    with pytest.raises(JumpBudgetError, match="took more than 0.05 s of CPU time .*structured_outputs_jump_timeout"):
        search.forced(Spinning(1.0))
    assert time.monotonic() - t0 < 0.9
    assert search.forced(Spinning(0.0)) == "x"  # a fresh thread serves the next search
    with pytest.raises(JumpBudgetError):
        search.forced(Spinning(1.0))
    # Two abandoned searches still run: new ones are skipped (no jump) until one ends.
    assert search.forced(Spinning(0.0)) is None
    deadline = time.monotonic() + 15
    while search.forced(Spinning(0.0)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert search.forced(Spinning(0.0)) == "x"


def test_a_search_that_ends_past_its_budget_between_polls_fails_too():
    """A search that spends more CPU than its budget fails its request whenever it ends:
    before the first poll (10 ms of CPU, polls every 20 ms, budget 1 ms) as after one.
    Which one it is depends on how the threads are scheduled, so the rule must not."""
    search = JumpSearch(budget=0.001)
    for _ in range(3):
        with pytest.raises(JumpBudgetError, match="took more than 0.001 s of CPU time"):
            search.forced(Spinning(0.01))


def test_a_search_waiting_for_the_cpu_is_not_failed():
    """The budget is the search thread's CPU time: a search that only waits (a loaded
    machine) is not failed by the wall clock."""

    class Sleeping:
        def find_jump_forward_string(self):
            time.sleep(0.3)
            return "y"

    assert JumpSearch(budget=0.05).forced(Sleeping()) == "y"


@pytest.mark.parametrize("schema, text, says", [
    ({"type": "string", "minLength": 3, "maxLength": 3}, b'"\x1a\x1a\x1a"',
     "it is not valid JSON (Invalid control character at: line 1 column 2 (char 1))"),
    ({"type": "string"}, b'"ab', "it is not valid JSON (Unterminated string"),
    ({"type": "string"}, b'"\xff"', "it is not valid UTF-8 (invalid start byte at byte 1)"),
    ({"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}}, b'{"a": 7}',
     "at #/a: 7 is greater than the maximum of 3"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, b"[1, 2]", "at #: [1, 2] is too long"),
    (None, b"[1]", "it is a JSON list, not an object"),
])
def test_an_invalid_output_says_why(schema, text, says):
    why = OutputChecker().why_invalid(None if schema is None else json.dumps(schema), text)
    assert why is not None and why.startswith(says), why


@pytest.mark.parametrize("schema, text", [
    ({"type": "string", "minLength": 3, "maxLength": 3}, b'"abc"'),
    ({"type": "string", "pattern": "^(a*)*b$"}, b'"' + b"a" * 40 + b'c"'),  # patterns are the grammar's: never re-run
    ({"type": "object", "patternProperties": {"^(a*)*b$": {"type": "integer"}}, "additionalProperties": False},
     b'{"' + b"a" * 40 + b'c": 1}'),
    (None, b' {"a": [1, {"b": null}]}'),
])
def test_a_valid_output_passes_and_no_pattern_runs_on_the_engine_thread(schema, text):
    t0 = time.monotonic()
    assert OutputChecker().why_invalid(None if schema is None else json.dumps(schema), text) is None
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("kind, spec, nested, jump", [
    ("regex", "ab{12}c", 12, "inline"),
    ("regex", r"(ab|c)[0-9]{2,4}-(yes|no)", 4, "inline"),
    ("json", {"type": "object"}, 8, "inline"),  # whitespace{0, 8}
    ("regex", "(a{0,30}a{30}){30}", 900, "budget"),  # 0.16 s a search
    ("regex", "((a{0,10}a{10}){10}){10}", 1000, "budget"),  # 17 s a search
    ("regex", "(a{0,256}a{256}){16}", 4096, "off"),  # one search ran out of 4 GB
    ("regex", "a{0,3000}a{3000}", 3000, "off"),  # ~2 s a search at 5000
    ("regex", "x{5000}", 5000, "off"),
])
def test_how_a_grammars_jump_forward_searches_run(kind, spec, nested, jump):
    cost = check(kind, spec, any_whitespace=True, max_whitespace_cnt=8) if kind == "json" else check(kind, spec)
    assert (cost.nested, cost.jump) == (nested, jump)
