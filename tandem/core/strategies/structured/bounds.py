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
longer than its rules' shortest texts, which bounds the forced text; the time
of one search is bounded apart (``jump.py``, a CPU-time budget).
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Callable

# Repetitions of an element that can match nothing: each count is a parser state.
MAX_NULLABLE_REPEAT = 128
# The engine option's default (EngineConfig.structured_outputs_max_repeat).
DEFAULT_MAX_REPEAT = 10_000

_INF = float("inf")
_RULE = re.compile(r"([A-Za-z_][A-Za-z0-9_.\-]*) ::= ")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_COUNT = re.compile(r"\{\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\}")


class GrammarBoundsError(ValueError):
    """A grammar over a cost bound (the message says which and where)."""


class _Unreadable(Exception):
    pass


def check_bounds(ebnf: str, max_repeat: int, regex_grammar: Callable[[str], str] | None = None) -> float:
    """Raise ``GrammarBoundsError`` where the grammar ``ebnf`` (xgrammar's printed
    form) is over a bound (module doc); a text this reader cannot follow is refused
    too, rather than let through unchecked. ``regex_grammar(pattern)``: the printed
    grammar of a regex, for the ``Regex("...")`` rules of a JSON schema's
    ``patternProperties`` / ``propertyNames``, each checked the same way. Returns
    the shortest text of the root rule."""
    try:
        parsed = _parse(ebnf)
    except _Unreadable as e:
        raise GrammarBoundsError(f"its grammar could not be checked for its cost ({e}), so it is not compiled") from None
    # A lazy regex is a literal as long as its own shortest text, once checked alone.
    for alts in parsed.values():
        for seq in alts:
            for k, (atom, lo, hi) in enumerate(seq):
                if atom[0] == "regex":
                    if regex_grammar is None:
                        raise GrammarBoundsError("its grammar holds a Regex(...) rule that could not be checked")
                    try:
                        sub = regex_grammar(atom[1])
                    except Exception as e:  # noqa: BLE001 - xgrammar's parser
                        raise GrammarBoundsError(f"its pattern {atom[1][:80]!r} could not be read: {e}") from None
                    seq[k] = (("lit", check_bounds(sub, max_repeat, regex_grammar)), lo, hi)
    rules, owner = _flatten(parsed)
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
    return shortest["root"]


# -- reading xgrammar's printed grammar ---------------------------------------
# A rule is a list of alternatives, each a list of elements; an element is
# (atom, lo, hi) with hi == -1 for no upper bound, and an atom is
# ("lit", length) | ("ref", name) | ("group", alternatives).


def _parse(text: str) -> dict[str, list]:
    rules: dict[str, list] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _RULE.match(line)
        if m is None:
            raise _Unreadable(f"a line that is not a rule: {line[:60]!r}")
        p = _Parser(line, m.end())
        alts = p.alternatives()
        p.skip()
        if p.peek("(="):  # a lookahead: it matches no text
            p.i += 2
            p.alternatives()
            p.expect(")")
            p.skip()
        if p.i != len(line):
            raise _Unreadable(f"unexpected {line[p.i:p.i + 20]!r} in rule {m.group(1)!r}")
        rules[m.group(1)] = alts
    return rules


class _Parser:
    def __init__(self, s: str, i: int) -> None:
        self.s, self.i = s, i

    def skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def peek(self, t: str) -> bool:
        return self.s.startswith(t, self.i)

    def expect(self, t: str) -> None:
        self.skip()
        if not self.peek(t):
            raise _Unreadable(f"expected {t!r} at {self.s[self.i:self.i + 20]!r}")
        self.i += len(t)

    def alternatives(self) -> list:
        alts = [self.sequence()]
        while True:
            self.skip()
            if not self.peek("|"):
                return alts
            self.i += 1
            alts.append(self.sequence())

    def sequence(self) -> list:
        seq = []
        while True:
            self.skip()
            if self.i >= len(self.s) or self.s[self.i] in "|)" or self.peek("(="):
                return seq
            atom = self.atom()
            lo, hi = 1, 1
            if self.i < len(self.s):
                c = self.s[self.i]
                if c == "*":
                    lo, hi, self.i = 0, -1, self.i + 1
                elif c == "+":
                    lo, hi, self.i = 1, -1, self.i + 1
                elif c == "?":
                    lo, hi, self.i = 0, 1, self.i + 1
                elif c == "{":
                    m = _COUNT.match(self.s, self.i)
                    if m is None:
                        raise _Unreadable(f"a count {self.s[self.i:self.i + 20]!r}")
                    lo = int(m.group(1))
                    hi = int(m.group(2)) if m.group(2) is not None else lo
                    self.i = m.end()
            seq.append((atom, lo, hi))

    def atom(self):
        s, i = self.s, self.i
        c = s[i]
        if c == '"':
            n, i = 0, i + 1
            while i < len(s) and s[i] != '"':
                i += 2 if s[i] == "\\" else 1
                n += 1
            if i >= len(s):
                raise _Unreadable("an unterminated string")
            self.i = i + 1
            return ("lit", n)
        if c == "[":
            i += 1
            while i < len(s) and s[i] != "]":
                i += 2 if s[i] == "\\" else 1
            if i >= len(s):
                raise _Unreadable("an unterminated character class")
            self.i = i + 1
            return ("lit", 1)
        if c == "(":
            self.i += 1
            alts = self.alternatives()
            self.expect(")")
            return ("group", alts)
        m = _NAME.match(s, i)
        if m is None:
            raise _Unreadable(f"unexpected {s[i:i + 20]!r}")
        self.i = m.end()
        if self.peek("(") and m.group(0) == "Regex":  # Regex("pattern", json_string=true): a lazy regex
            return ("regex", self._regex_call())
        if self.peek("("):  # another macro (TagDispatch, ...): not a form this reader knows
            raise _Unreadable(f"the construct {m.group(0)}(...)")
        return ("ref", m.group(0))

    def _regex_call(self) -> str:
        s = self.s
        i = self.i + 1
        if i >= len(s) or s[i] != '"':
            raise _Unreadable("a Regex(...) without a pattern")
        j = i + 1
        while j < len(s) and s[j] != '"':
            j += 2 if s[j] == "\\" else 1
        try:
            pattern = json.loads(s[i:j + 1])
        except ValueError:
            raise _Unreadable("a Regex(...) pattern") from None
        depth, k = 1, j + 1
        while k < len(s) and depth:
            depth += {"(": 1, ")": -1}.get(s[k], 0)
            k += 1
        if depth:
            raise _Unreadable("an unterminated Regex(...)")
        self.i = k
        return pattern


def _flatten(rules: dict[str, list]) -> tuple[dict[str, list], dict[str, str]]:
    """Each group made a rule of its own (named ``rule#k``), so every element is a
    literal or a rule; and each rule's owner (the named rule it came from)."""
    flat: dict[str, list] = {}
    owner: dict[str, str] = {}

    def add(name: str, alts: list, own: str) -> None:
        owner[name] = own
        out = []
        for seq in alts:
            row = []
            for atom, lo, hi in seq:
                if atom[0] == "group":
                    sub = f"{own}#{len(owner)}"
                    add(sub, atom[1], own)
                    atom = ("ref", sub)
                row.append((atom, lo, hi))
            out.append(row)
        flat[name] = out

    for name, alts in rules.items():
        add(name, alts, name)
    return flat, owner


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
