"""What a grammar may cost, checked on xgrammar's own grammar before compiling.

Every kind (a JSON schema, a regex, an EBNF grammar, the choices) becomes an
xgrammar ``Grammar`` first; its text (``str(grammar)``, xgrammar's normalised EBNF:
one rule a line, repetitions as ``elem{lo, hi}``) is read here and refused where
matching it could run away:

* a repetition count over ``max_repeat`` (regex ``x{2147483647}``, EBNF
  ``"x"{5000}``, schema ``minLength`` / ``maxLength`` / ``minItems`` /
  ``maxItems`` / ``minProperties`` / ``maxProperties``, which xgrammar writes as
  counts): each count is a loop of the matcher's;
* an element that can match the empty text repeated more than
  ``MAX_NULLABLE_REPEAT`` times (``(a?){5000}``: the parser keeps a state for every
  count it may be at, and finding the forced text after it took 24 s a call);
* a rule whose shortest text is longer than ``max_repeat`` characters (the
  expansion of nested counts, ``((x{1000}){1000})``: forced text that long is
  built a character at a time);
* a rule that can never end (``root ::= "x" root``, a schema whose ``$ref``
  recursion is required at every level): from inside it the grammar forces text
  forever, and the search for it grows memory until the process is killed.

Once these hold, every state the matcher can reach has a finite completion no
longer than its rules' shortest texts, which bounds the forced text. What one
search for it costs grows with the product of nested counts as well, which the
check measures (``GrammarCost``): by it a grammar's searches run on the step's
thread, in a thread under a CPU-time budget (``jump.py``), or not at all.
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

# Repetitions of an element that can match nothing: each count is a parser state.
MAX_NULLABLE_REPEAT = 128
# The engine option's default (EngineConfig.structured_outputs_max_repeat).
DEFAULT_MAX_REPEAT = 10_000
# GrammarCost.jump: how a grammar's jump-forward searches run, by its nested counts
# and its rules' shortest texts (measured: docs/structured_output.md).
INLINE_NESTED = 128
BUDGET_NESTED = 1024
JUMP_MAX_SHORTEST = 4096

_INF = float("inf")
_RULE = re.compile(r"([A-Za-z_][A-Za-z0-9_.\-]*) ::= ")


class GrammarBoundsError(ValueError):
    """A grammar over a cost bound (the message says which and where)."""


class _Unreadable(Exception):
    pass


@dataclass(frozen=True)
class GrammarCost:
    """What the check measured: the root rule's shortest text, the largest count, the
    longest shortest text of any reachable rule (characters), and the largest
    product of nested counts (``((a{0,10}a{10}){10}){10}``: 1000), which is what the
    parser's states multiply by: that one took 17 s to search for its forced text,
    ``(a{0,256}a{256}){16}`` (4096) ran out of 4 GB."""

    root_shortest: float
    max_count: int
    max_shortest: float
    nested: int

    @property
    def jump(self) -> str:
        """How its jump-forward searches run (``jump.py``): "inline" on the step's thread
        (cheap: no budget needed), "budget" in the search thread under the CPU-time
        budget, or "off" (no jump-forward: the search's memory would not be bounded;
        its tokens are decoded one at a time, each mask and accept bounded by the counts)."""
        if self.max_shortest > JUMP_MAX_SHORTEST:
            return "off"
        if self.nested <= INLINE_NESTED:
            return "inline"
        return "budget" if self.nested <= BUDGET_NESTED else "off"


def check_bounds(ebnf: str, max_repeat: int, regex_grammar: Callable[[str], str] | None = None) -> GrammarCost:
    """Raise ``GrammarBoundsError`` where the grammar ``ebnf`` (xgrammar's printed
    form) is over a bound (module doc); a text this reader cannot follow is refused
    too, rather than let through unchecked. ``regex_grammar(pattern)``: the printed
    grammar of a regex, for the ``Regex("...")`` rules of a JSON schema's
    ``patternProperties`` / ``propertyNames``, each checked the same way. Returns
    what it measured."""
    try:
        rules, owner = _parse(ebnf)
    except _Unreadable as e:
        raise GrammarBoundsError(f"its grammar could not be checked for its cost ({e}), so it is not compiled") from None
    # A lazy regex is a literal as long as its own shortest text, once checked alone.
    max_count, max_shortest, max_nested = 0, 0.0, 1
    for alts in rules.values():
        for seq in alts:
            for k, (atom, lo, hi) in enumerate(seq):
                if atom[0] == "regex":
                    if regex_grammar is None:
                        raise GrammarBoundsError("its grammar holds a Regex(...) rule that could not be checked")
                    try:
                        sub = regex_grammar(atom[1])
                    except Exception as e:  # noqa: BLE001 - xgrammar's parser
                        raise GrammarBoundsError(f"its pattern {atom[1][:80]!r} could not be read: {e}") from None
                    cost = check_bounds(sub, max_repeat, regex_grammar)
                    max_count, max_shortest = max(max_count, cost.max_count), max(max_shortest, cost.max_shortest)
                    max_nested = max(max_nested, cost.nested)
                    seq[k] = (("lit", cost.root_shortest), lo, hi)
    if "root" not in rules:
        raise GrammarBoundsError("its grammar has no root rule")
    reachable = _reachable(rules)
    for name in reachable:
        for seq in rules[name]:
            for atom, lo, hi in seq:
                if max(lo, hi) > max_repeat:
                    raise GrammarBoundsError(
                        f"a repetition count of {max(lo, hi)} (in rule {owner[name]!r}), over the limit of "
                        f"{max_repeat} (engine option structured_outputs_max_repeat)")
    shortest = _shortest(rules)
    for name in sorted(reachable):
        if shortest[name] == _INF:
            raise GrammarBoundsError(
                f"rule {owner[name]!r} can never end: every way through it leads back into it, so no finite text "
                "completes it (with a JSON schema: a $ref recursion that every level requires)")
    for name in sorted(reachable):
        for seq in rules[name]:
            for atom, lo, hi in seq:
                if hi > MAX_NULLABLE_REPEAT and _min_of(atom, shortest) == 0:
                    raise GrammarBoundsError(
                        f"an element that can match nothing repeated up to {hi} times (in rule {owner[name]!r}), over "
                        f"the limit of {MAX_NULLABLE_REPEAT}: repeat something that cannot be empty (write (a?){{n}} "
                        "as a{0,n})")
        if shortest[name] > max_repeat:
            raise GrammarBoundsError(
                f"rule {owner[name]!r} matches no text shorter than {shortest[name]:.0f} characters, over the limit of "
                f"{max_repeat} (engine option structured_outputs_max_repeat): nested counts multiply")
    for name in reachable:
        max_shortest = max(max_shortest, shortest[name])
        for seq in rules[name]:
            for _, lo, hi in seq:
                max_count = max(max_count, lo, hi)
    nested = max(max_nested, _nested(rules, reachable))
    return GrammarCost(shortest["root"], max_count, max_shortest, nested)


def _nested(rules: dict[str, list], reachable: set[str]) -> int:
    """The largest product of counts along a nesting of counted repetitions (an
    element repeated ``{lo, hi}`` with ``hi >= 2`` multiplies what it holds by ``hi``;
    ``*`` and ``+`` hold no counter). A rule reached again inside itself counts 1
    there. Iterative: grammars nest deeper than Python's stack."""
    memo: dict[str, int] = {}
    for start in sorted(reachable):
        if start in memo:
            continue
        stack = [(start, False)]
        active: set[str] = set()
        while stack:
            name, done = stack.pop()
            if done:
                best = 1
                for seq in rules[name]:
                    for atom, _, hi in seq:
                        inner = memo.get(atom[1], 1) if atom[0] == "ref" else 1
                        best = max(best, inner * (hi if hi >= 2 else 1))
                memo[name] = min(best, 1 << 62)
                active.discard(name)
                continue
            if name in memo or name in active:
                continue
            active.add(name)
            stack.append((name, True))
            for seq in rules[name]:
                for atom, _, _ in seq:
                    if atom[0] == "ref" and atom[1] not in memo and atom[1] not in active:
                        stack.append((atom[1], False))
    return max((memo.get(n, 1) for n in reachable), default=1)


# -- reading xgrammar's printed grammar ---------------------------------------
# A rule is a list of alternatives, each a list of elements (atom, lo, hi), hi == -1
# for no upper bound; an atom is ("lit", length) | ("ref", rule) | ("regex", pattern).
# A parenthesised group becomes a rule of its own, named ``rule#k``.

_TOKEN = re.compile(r"""
    \s+
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<count>\{\s*-?\d+\s*(?:,\s*-?\d+\s*)?\})
  | (?P<look>\(=)
  | (?P<punct>[()|*+?,=])
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
""", re.VERBOSE)
_ESCAPE = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)")


def _tokens(line: str, start: int) -> list[tuple[str, str]]:
    out, i, n = [], start, len(line)
    while i < n:
        m = _TOKEN.match(line, i)
        if m is None:
            raise _Unreadable(f"unexpected {line[i:i + 20]!r}")
        i = m.end()
        kind = m.lastgroup
        if kind is not None:
            out.append((kind, m.group(kind)))
    return out


def _parse(text: str) -> tuple[dict[str, list], dict[str, str]]:
    rules: dict[str, list] = {}
    owner: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _RULE.match(line)
        if m is None:
            raise _Unreadable(f"a line that is not a rule: {line[:60]!r}")
        name = m.group(1)
        owner[name] = name
        p = _Reader(_tokens(line, m.end()), name, rules, owner)
        rules[name] = p.alternatives()
        if p.peek("look"):  # a lookahead: it matches no text
            p.i += 1
            p.alternatives()
            p.expect(")")
        if p.i != len(p.toks):
            raise _Unreadable(f"unexpected {p.toks[p.i][1][:20]!r} in rule {name!r}")
    return rules, owner


class _Reader:
    def __init__(self, toks: list[tuple[str, str]], rule: str, rules: dict, owner: dict) -> None:
        self.toks, self.i, self.rule, self.rules, self.owner = toks, 0, rule, rules, owner

    def peek(self, kind: str, value: str | None = None) -> bool:
        if self.i >= len(self.toks):
            return False
        k, v = self.toks[self.i]
        return k == kind and (value is None or v == value)

    def expect(self, value: str) -> None:
        if not self.peek("punct", value):
            got = self.toks[self.i][1][:20] if self.i < len(self.toks) else "the end"
            raise _Unreadable(f"expected {value!r}, not {got!r}")
        self.i += 1

    def alternatives(self) -> list:
        alts = [self.sequence()]
        while self.peek("punct", "|"):
            self.i += 1
            alts.append(self.sequence())
        return alts

    def sequence(self) -> list:
        seq, toks = [], self.toks
        while self.i < len(toks):
            kind, value = toks[self.i]
            if kind == "look" or (kind == "punct" and value in "|)"):
                break
            atom = self.atom()
            lo = hi = 1
            if self.i < len(toks):
                kind, value = toks[self.i]
                if kind == "punct" and value in "*+?":
                    lo, hi = _SUFFIX[value]
                    self.i += 1
                elif kind == "count":
                    parts = value[1:-1].split(",")
                    lo = int(parts[0])
                    hi = int(parts[1]) if len(parts) > 1 else lo
                    self.i += 1
            seq.append((atom, lo, hi))
        return seq

    def atom(self):
        kind, value = self.toks[self.i]
        self.i += 1
        if kind == "str":
            return ("lit", len(_ESCAPE.sub("_", value[1:-1])))
        if kind == "cls":
            return ("lit", 1)
        if kind == "punct" and value == "(":
            alts = self.alternatives()
            self.expect(")")
            sub = f"{self.rule}#{len(self.owner)}"
            self.owner[sub] = self.rule
            self.rules[sub] = alts
            return ("ref", sub)
        if kind != "name":
            raise _Unreadable(f"unexpected {value[:20]!r}")
        if self.peek("punct", "("):
            if value != "Regex":  # a macro (TagDispatch, ...): not a form this reader knows
                raise _Unreadable(f"the construct {value}(...)")
            return ("regex", self._regex_call())
        return ("ref", value)

    def _regex_call(self) -> str:
        # Regex("pattern", json_string=true): a regex xgrammar expands lazily.
        self.i += 1
        if not self.peek("str"):
            raise _Unreadable("a Regex(...) without a pattern")
        try:
            pattern = json.loads(self.toks[self.i][1])
        except ValueError:
            raise _Unreadable("a Regex(...) pattern") from None
        self.i += 1
        while self.i < len(self.toks) and not self.peek("punct", ")"):
            if self.peek("punct", "("):
                raise _Unreadable("a Regex(...) argument")
            self.i += 1
        self.expect(")")
        return pattern


_SUFFIX = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}


def _reachable(rules: dict[str, list]) -> set[str]:
    seen, stack = {"root"}, ["root"]
    while stack:
        for seq in rules[stack.pop()]:
            for atom, _, _ in seq:
                if atom[0] == "ref" and atom[1] not in seen:
                    if atom[1] not in rules:
                        raise GrammarBoundsError(f"its grammar refers to rule {atom[1]!r}, which it does not define")
                    seen.add(atom[1])
                    stack.append(atom[1])
    return seen


def _min_of(atom, shortest: dict[str, float]) -> float:
    return atom[1] if atom[0] == "lit" else shortest.get(atom[1], _INF)


def _shortest(rules: dict[str, list]) -> dict[str, float]:
    """Each rule's shortest text (inf: none, it never ends), by Knuth's generalisation
    of Dijkstra to grammars: a rule's value is final once it is the smallest
    candidate, and an alternative's candidate is known once every rule it needs
    (an element repeated at least once) is."""
    users: dict[str, list[tuple[str, int]]] = {}
    waiting: dict[tuple[str, int], int] = {}
    heap: list[tuple[float, str]] = []
    shortest: dict[str, float] = {}

    def offer(name: str, k: int) -> None:
        v = sum(_min_of(atom, shortest) * lo for atom, lo, _ in rules[name][k] if lo)
        heapq.heappush(heap, (v, name))

    for name, alts in rules.items():
        for k, seq in enumerate(alts):
            need = {atom[1] for atom, lo, _ in seq if lo and atom[0] == "ref"}
            waiting[(name, k)] = len(need)
            for r in need:
                users.setdefault(r, []).append((name, k))
            if not need:
                offer(name, k)
    while heap:
        v, name = heapq.heappop(heap)
        if name in shortest:
            continue
        shortest[name] = v
        for key in users.get(name, ()):
            waiting[key] -= 1
            if waiting[key] == 0:
                offer(*key)
    for name in rules:
        shortest.setdefault(name, _INF)
    return shortest
