"""Modes: how a request's strategy is chosen, and the batch hooks a mode adds to a step.

A *mode* (plain sampling, beam search, speculation, structured output, a prompt
slot, or one a plugin registers) is a class registered by name
(``tandem.registry.ModeRegistry``, filled through the ``tandem_register_modes``
plugin hook). An engine builds one instance of each (``Mode(ctx)``: its
engine-wide state, e.g. a grammar compiler or a draft model's counters) and, for
each request, stacks the strategies of the modes that apply, innermost (lowest
``order``) first. Which modes combine is declared on the modes: ``excludes``
(refused together, with an error naming both) and ``yields_to`` (this mode steps
aside where one of those applies). The scheduler, engine core and worker call
only the hooks below and ``RequestStrategy``'s; none of them names a mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tandem.core.core_outputs import OutputShape
from tandem.core.scheduler_output import SamplingInputs
from tandem.core.strategies.base import RequestStrategy

# A strategy that keeps the base ``batch_items`` gives nothing (plain sampling): its
# requests skip the call, twice a step each.
_NO_ITEMS = RequestStrategy.batch_items

if TYPE_CHECKING:
    from tandem.core.sampling_params import SamplingParams
    from tandem.core.scheduler_output import SchedulerOutput
    from tandem.core.sequence import SequenceGroup
    from tandem.core.strategies.base import LogitsTransform


@dataclass(frozen=True)
class EngineContext:
    """What a mode may use of the engine that builds it. ``services``: engine-wide
    helpers by name (the engine's grammar compiler, its draft model)."""

    config: Any  # EngineConfig
    eos_token_ids: frozenset[int]
    vocab_size: int
    block_size: int
    services: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestContext:
    """A validated request, as the modes choose its strategy from it. ``options``:
    request options beyond ``SamplingParams`` by name (``"prompt_slot"``)."""

    request_id: str
    params: "SamplingParams"
    prompt_len: int
    encoder_token_ids: list[int] | None
    options: Mapping[str, Any] = field(default_factory=dict)


class Mode:
    """One mode, bound to one engine. Subclasses set ``name`` and implement
    ``applies`` and ``strategy``; the batch hooks are optional (no-ops here)."""

    name: ClassVar[str]
    # Where its strategy sits in a request's stack: lower runs inside higher.
    order: ClassVar[int] = 50
    # A base mode picks each step's tokens itself (sampling, beams): a request runs
    # exactly one (the lowest-order one that applies); the others wrap it.
    base: ClassVar[bool] = False
    excludes: ClassVar[frozenset[str]] = frozenset()
    yields_to: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def applies(self, req: RequestContext) -> bool:
        raise NotImplementedError

    def strategy(self, req: RequestContext, inner: "RequestStrategy | None") -> "RequestStrategy":
        """The request's strategy; ``inner`` is what it wraps (None for a base mode)."""
        raise NotImplementedError

    def output_shape(self, req: RequestContext, shape: OutputShape) -> OutputShape:
        """How the request's outputs are shaped, given the shape the modes inside this
        one gave (``params.n`` streamed completions where none changed it). Plain data
        the frontend's output processor follows (``core_outputs.OutputShape``)."""
        return shape

    # -- batch hooks -------------------------------------------------------------
    def before_schedule(self, items: list[tuple["SequenceGroup", Any]]) -> None:
        """Before the scheduler walks its running groups: ``items`` are what the
        running requests' strategies gave for this mode (``RequestStrategy.batch_items``
        with ``sg=None``): e.g. draft tokens proposed for all of them at once."""

    def logits_transform(self, items: list[Any]) -> tuple["LogitsTransform | None", dict[str, str]]:
        """After ``schedule()``: one transform of the step's logits (plain data sent
        beside the scheduler output) from what the scheduled requests' strategies gave
        (``batch_items`` with their ``ScheduledGroup``), and the requests that cannot
        run this step, with why (they fail alone)."""
        return None, {}

    def release(self, group: "SequenceGroup") -> None:
        """The group stopped running (preempted, aborted, finished)."""

    def has_pending(self) -> bool:
        """Work off the step loop that a waiting request needs (a grammar compiling)."""
        return False

    def wait(self, timeout: float) -> None:
        """Block until pending work may have progressed, at most ``timeout`` seconds."""

    def stats(self) -> dict[str, int | float]:
        """Counters published with the engine's stats (keys unique across modes)."""
        return {}

    def shutdown(self) -> None:
        pass


class Modes:
    """The modes of one engine: strategy selection, and the batch hooks the
    scheduler and the engine core call over all of them."""

    def __init__(self, modes: Iterable[Mode]) -> None:
        self.modes = sorted(modes, key=lambda m: (m.order, m.name))
        self.by_name = {m.name: m for m in self.modes}

    @classmethod
    def build(cls, registry, ctx: EngineContext) -> "Modes":
        """One instance of every mode ``registry`` (``names()``, ``load(name)``) holds."""
        return cls(registry.load(name)(ctx) for name in registry.names())

    # -- selection ----------------------------------------------------------------
    def strategy(self, req: RequestContext) -> "RequestStrategy":
        """The request's stacked strategy; ``ValueError`` naming both modes where two
        that apply exclude each other."""
        return self.plan(req)[0]

    def plan(self, req: RequestContext) -> tuple["RequestStrategy", OutputShape]:
        """The request's stacked strategy and its output shape (each mode that runs
        it refines the shape, innermost first); ``ValueError`` as :meth:`strategy`."""
        active = self._active(req)
        strategy, shape = None, OutputShape(req.params.n)
        for m in active:
            strategy = m.strategy(req, strategy)
            shape = m.output_shape(req, shape)
        return strategy, shape

    def _active(self, req: RequestContext) -> list[Mode]:
        active = [m for m in self.modes if m.applies(req)]
        names = {m.name for m in active}
        active = [m for m in active if not (m.yields_to & names)]
        bases = [m for m in active if m.base]
        if len(bases) > 1:
            active = [m for m in active if not m.base or m is bases[0]]
        names = {m.name for m in active}
        for m in active:
            for other in active:
                if other.name in m.excludes:
                    raise ValueError(
                        f"request {req.request_id!r}: mode {m.name!r} cannot be combined with mode "
                        f"{other.name!r} (declared by {m.name!r}: excludes {sorted(m.excludes)})")
        if not any(m.base for m in active):
            raise ValueError(f"request {req.request_id!r}: no base mode applies (modes: {sorted(names)})")
        return active

    # -- batch hooks ----------------------------------------------------------------
    def before_schedule(self, groups: Iterable["SequenceGroup"]) -> list[tuple["SequenceGroup", Exception]]:
        """Returns the groups whose strategy raised giving its items (they fail alone),
        and those of a mode whose hook raised (it concerns every request it was given)."""
        items: dict[str, list] = {}
        failed = []
        for group in groups:
            if type(group.strategy).batch_items is _NO_ITEMS:  # gives nothing: skip the call
                continue
            try:
                mine = list(group.strategy.batch_items(group, None))
            except Exception as e:  # noqa: BLE001 - this request's strategy
                failed.append((group, e))
                continue
            for name, item in mine:
                items.setdefault(name, []).append((group, item))
        for name, its in items.items():
            try:
                self.by_name[name].before_schedule(its)
            except Exception as e:  # noqa: BLE001 - the mode's batch work for these requests
                why = RuntimeError(f"mode {name!r}: before_schedule failed: {type(e).__name__}: {e}")
                seen = {id(g) for g, _ in failed}
                for group, _ in its:
                    if id(group) not in seen:
                        seen.add(id(group))
                        failed.append((group, why))
        return failed

    def sampling_inputs(self, sched: "SchedulerOutput", groups: Mapping[str, "SequenceGroup"]
                        ) -> tuple[SamplingInputs | None, dict[str, str]]:
        """The step's logits transforms (None: none), and requests that cannot run."""
        items: dict[str, list] = {}
        failed: dict[str, str] = {}
        for sg in sched.scheduled:
            group = groups.get(sg.request_id)
            if group is None or type(group.strategy).batch_items is _NO_ITEMS:
                continue
            try:
                mine = list(group.strategy.batch_items(group, sg))
            except Exception as e:  # noqa: BLE001 - this request's strategy: it fails alone
                failed[sg.request_id] = f"{type(e).__name__}: {e}"
                continue
            for name, item in mine:
                items.setdefault(name, []).append((sg.request_id, item))
        transforms = []
        for name, its in items.items():
            try:
                t, f = self.by_name[name].logits_transform([item for _, item in its])
            except Exception as e:  # noqa: BLE001 - the mode's transform of these requests' rows
                why = f"mode {name!r}: logits_transform failed: {type(e).__name__}: {e}"
                failed.update((rid, why) for rid, _ in its if rid not in failed)
                continue
            failed.update(f)
            if t is not None:
                transforms.append(t)
        return (SamplingInputs(transforms) if transforms else None), failed

    def release(self, group: "SequenceGroup") -> None:
        for m in self.modes:
            m.release(group)

    def has_pending(self) -> bool:
        return any(m.has_pending() for m in self.modes)

    def wait(self, timeout: float) -> None:
        for m in self.modes:
            if m.has_pending():
                m.wait(timeout)
                return

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for m in self.modes:
            out.update(m.stats())
        return out

    def shutdown(self) -> None:
        for m in self.modes:
            m.shutdown()
