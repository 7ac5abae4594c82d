"""Jump-forward decoding: where a request's grammar admits exactly one continuation
(xgrammar's ``find_jump_forward_string``: keys, punctuation, the rest of an enum
value once its prefix decides it), its tokens are appended to the sequence right
after the sampled token, and the next step computes them as one decoder chunk
with that token (as it computes draft tokens: ``Sequence.num_new_tokens`` > 1,
logits for the last position only) instead of one forward pass each.

The token boundary (SGLang's retokenization). The forced text follows the token
just sampled; the tokenizer might write the two differently together (``"`` then
``name"`` is ``"name`` then ``"`` for a BPE that merged ``"name``). So the sampled
token's text and the forced text are tokenized together; where that changes the
sampled token, the sampled token is *replaced* by the first token of the new
tokenization. Nothing needs rolling back but the matcher: the sampled token has
not been emitted yet (this runs in the step's update, before its output is built)
and its keys and values are not computed yet (that is the next step's chunk).
The other way, jumping only over what tokenizes stably, can stall: a model that
keeps sampling a token that merges with the forced text would never jump. Either
way the text is the same; only how it is cut into tokens differs.

The jump is taken only when it checks out: the new tokens' strings (xgrammar's
view of the vocabulary) spell exactly the sampled token's text and the forced
text, none is a special or stop token, and the matcher accepts them all;
otherwise the matcher is rolled back and the sequence decodes as without jumps.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.core.sampling_params import SamplingParams

# One jump appends at most this many tokens (a running sequence's chunk is not
# counted against the step's token budget: this bounds what one jump adds to a step);
# a longer forced string goes on after the next sampled token.
MAX_JUMP_TOKENS = 32
# Forced text tokenized at once (bounds the tokenizer's work per jump).
MAX_JUMP_CHARS = 256


# The engine option's default (EngineConfig.structured_outputs_jump_timeout): CPU seconds.
DEFAULT_JUMP_TIMEOUT_S = 0.25
# Searches past their budget that may still run (their threads cannot be stopped) before
# new searches wait for one to end: meanwhile sequences decode without jumping.
MAX_ABANDONED = 2
# However slowly a loaded machine gives the search its CPU time, the step waits no longer.
_WALL_LIMIT_S = 30.0
_POLL_S = 0.02


class JumpBudgetError(RuntimeError):
    """One jump-forward search passed its CPU-time budget (the message names it)."""


class _Searcher:
    """One daemon thread running ``find_jump_forward_string`` calls (xgrammar releases
    the GIL in them, so the step waits without holding other threads up)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self.clock: int | None = None
        self.thread = threading.Thread(target=self._run, name="tandem-jump-forward", daemon=True)
        self.thread.start()
        self._ready.wait()

    def _run(self) -> None:
        try:
            self.clock = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError):  # not on this platform: the budget is wall time
            self.clock = None
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            matcher, future = job
            try:
                future.set_result(matcher.find_jump_forward_string())
            except BaseException as e:  # noqa: BLE001 - the caller's
                future.set_exception(e)

    def cpu(self) -> float:
        return time.clock_gettime(self.clock) if self.clock is not None else time.monotonic()

    def submit(self, matcher) -> cf.Future:
        future: cf.Future = cf.Future()
        self._jobs.put((matcher, future))
        return future

    def retire(self) -> None:
        self._jobs.put(None)  # ends once the search under way returns


class JumpSearch:
    """``find_jump_forward_string`` under a CPU-time budget, off the calling thread.
    The grammar's cost bounds (``bounds.py``) keep every search finite; this keeps the
    step from waiting for a slow one: past ``budget`` CPU seconds of its thread the
    search is abandoned (it runs on in its daemon thread, holding nothing the engine
    needs) and ``JumpBudgetError`` fails that request alone."""

    def __init__(self, budget: float = DEFAULT_JUMP_TIMEOUT_S) -> None:
        self.budget = budget
        self._searcher: _Searcher | None = None
        self._abandoned: list[_Searcher] = []

    def forced(self, matcher, inline: bool = False) -> str | None:
        """The text ``matcher``'s grammar forces next; None: not searched (abandoned
        searches still run: the sequence decodes this step without a jump). ``inline``:
        the grammar's searches are cheap (``bounds.GrammarCost.jump``): searched here."""
        if inline:
            return matcher.find_jump_forward_string()
        if self._abandoned:
            self._abandoned = [s for s in self._abandoned if s.thread.is_alive()]
            if len(self._abandoned) >= MAX_ABANDONED:
                return None
        if self._searcher is None:
            self._searcher = _Searcher()
        searcher = self._searcher
        start, wall = searcher.cpu(), time.monotonic()
        future = searcher.submit(matcher)
        while True:
            try:
                text = future.result(timeout=_POLL_S)
            except cf.TimeoutError:
                if searcher.cpu() - start > self.budget or time.monotonic() - wall > _WALL_LIMIT_S:
                    break
                continue
            # A search that ended past its budget fails as one abandoned would: on a loaded
            # machine this thread may poll late, and the rule must not depend on when it does.
            if searcher.cpu() - start > self.budget:
                raise self._over_budget()
            return text
        searcher.retire()
        self._abandoned.append(searcher)
        self._searcher = None
        raise self._over_budget()

    def _over_budget(self) -> JumpBudgetError:
        return JumpBudgetError(
            f"finding the text its grammar forces next took more than {self.budget:g} s of CPU time (engine option "
            "structured_outputs_jump_timeout); the engine option structured_outputs_disable_jump_forward decodes "
            "such grammars a token at a time")


@dataclass
class JumpCounters:
    """Since the engine started: tokens appended by jumps (not sampled), sequence
    steps that jumped, and jumps that replaced the sampled token (retokenized)."""

    tokens: int = 0
    jumps: int = 0
    retokenized: int = 0


def jump_stats(c: JumpCounters) -> dict[str, int]:
    return {
        "structured_jump_forward_tokens": c.tokens,
        "structured_jump_forward_steps": c.jumps,
        "structured_jump_forward_retokenized": c.retokenized,
    }


def why_not_exact(params: "SamplingParams") -> str | None:
    """Why jumping would not give the tokens plain masked decoding could give this
    request (None: it may jump): jumped tokens are not scored, so they carry no
    logprob and no processor or ban sees them."""
    if params.logprobs is not None:
        return "logprobs"  # a jumped token has no score of the model's
    for name in ("bad_words_ids", "suppress_tokens", "allowed_token_ids", "logit_bias", "logits_processors"):
        if getattr(params, name):
            return name  # it might ban a forced token: plain decoding then has no token to sample there
    if params.no_repeat_ngram_size:
        return "no_repeat_ngram_size"
    if params.forced_eos_token_id is not None:
        return "forced_eos_token_id"  # it forces EOS at the last position a jump may fill
    return None


class JumpForward:
    """One per engine: the forced tokens after a sampled token, the matcher moved
    past them. ``token_bytes``: each id's text as the grammar sees it (xgrammar's
    ``TokenizerInfo.decoded_vocab``); ``never``: ids a jump never appends (special
    and stop tokens, ids past the tokenizer's vocabulary)."""

    def __init__(self, tokenizer, token_bytes: list[bytes], never: set[int], counters: JumpCounters,
                 search: JumpSearch | None = None) -> None:
        self.tokenizer, self.token_bytes, self.never, self.counters = tokenizer, token_bytes, never, counters
        self.search = search if search is not None else JumpSearch()

    def after(self, matcher: Any, last: int, room: int, stop_ids: frozenset[int] = frozenset(),
              inline: bool = False) -> list[int] | None:
        """``matcher`` has accepted ``last``, the token just sampled; ``room``: tokens
        the sequence may still append. Returns the tokens that replace ``last`` (the
        first) and follow it, the matcher moved past them; None (matcher unchanged):
        no jump. Jumped tokens stop before any of ``stop_ids``. Raises
        ``JumpBudgetError`` where the search passed its budget (the request fails);
        ``inline``: search on this thread (``JumpSearch.forced``)."""
        if room <= 0:
            return None
        text = self.search.forced(matcher, inline)
        if not text:
            return None
        cut = len(text) > MAX_JUMP_CHARS
        text = text[:MAX_JUMP_CHARS]
        ids = self._tokens(last, text)
        if ids is None or (ids[0] != last and ids[0] in stop_ids):
            return None
        if cut and len(ids) > 2:
            ids = ids[:-1]  # its last token may be the start of a longer one past the cut
        n = min(len(ids) - 1, room, MAX_JUMP_TOKENS)
        for j in range(1, n + 1):
            if ids[j] in stop_ids:  # sampled as plain decoding would (min_tokens may ban it)
                n = j - 1
                break
        ids = ids[: n + 1]
        if ids == [last]:
            return None
        matcher.rollback(1)
        for j, t in enumerate(ids):
            if not matcher.accept_token(t):
                matcher.rollback(j)
                if not matcher.accept_token(last):
                    raise RuntimeError(f"the grammar matcher refused token {last} it had accepted")
                return None
        c = self.counters
        c.tokens += len(ids) - 1
        c.jumps += 1
        c.retokenized += ids[0] != last
        return ids

    def _tokens(self, last: int, text: str) -> list[int] | None:
        """The tokenizer's tokens for ``last``'s text then ``text`` (their first the
        token that replaces ``last``), where they spell it exactly; else ``last``
        then ``text`` tokenized alone (``last``'s text is not whole UTF-8, or the two
        tokenized together do not spell it); None where neither does."""
        head, tail = self.token_bytes[last], text.encode("utf-8")
        try:
            whole = (head + tail).decode("utf-8")
        except UnicodeDecodeError:
            whole = None
        if head and whole is not None:
            ids = self._encode(whole)
            if ids and self._spells(ids, head + tail):
                return ids
        ids = self._encode(text)
        if ids and self._spells(ids, tail):
            return [last] + ids
        return None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _spells(self, ids: list[int], want: bytes) -> bool:
        tb, never = self.token_bytes, self.never
        if any(i in never or not 0 <= i < len(tb) for i in ids):
            return False
        return b"".join(tb[i] for i in ids) == want
