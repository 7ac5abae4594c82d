"""Loading plugins from the ``tandem.plugins`` entry-point group."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

import pluggy

from tandem.plugins import hookspecs
from tandem.registry._lazy import DuplicateRegistrationError

ENTRY_POINT_GROUP = "tandem.plugins"
ENV_VAR = "TANDEM_PLUGINS"
# tandem's own distribution: its plugins (tandem-models, tandem-torch-sdpa, ...) run first.
TANDEM_DISTRIBUTION = "tandem-engine"
_HOOKS = ("tandem_register_models", "tandem_register_attention_backends")


class PluginError(RuntimeError):
    """A plugin failed to import, or one of its hooks raised."""


@dataclass
class PluginInfo:
    name: str  # the entry point's name
    value: str  # what it points at, "package.module[:object]"
    distribution: str | None
    models: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
    # Each backend's capabilities as lines of text (BackendCapabilities.describe()),
    # plus "here": whether it can serve on this machine; filled by plugin_report.
    backend_capabilities: dict[str, dict[str, str]] = field(default_factory=dict)
    # Why the plugin is broken ("failed to import: ModuleNotFoundError: ..."); None when healthy.
    error: str | None = None


def allowed_plugins() -> set[str] | None:
    """Names from ``$TANDEM_PLUGINS``, or None when every plugin may load."""
    raw = os.environ.get(ENV_VAR)
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def exclusion_hint(infos: list[PluginInfo]) -> str:
    """How to run without the broken plugins: the ``$TANDEM_PLUGINS`` value that leaves them out."""
    healthy = [i.name for i in infos if i.error is None]
    broken = [i for i in infos if i.error is not None]
    it = "it" if len(broken) == 1 else "them"
    dists = sorted({i.distribution for i in broken if i.distribution})
    if dists:
        uninstall = f"`pip uninstall {' '.join(dists)}`"
    else:  # an entry point handed to PluginManager directly, with no distribution behind it
        uninstall = f"remove {it} from the '{ENTRY_POINT_GROUP}' entry points"
    if not healthy:  # an empty TANDEM_PLUGINS means "all", so it cannot leave everything out
        return f"no other plugin loads, so {ENV_VAR} cannot leave {it} out: fix {it} or {uninstall}"
    return f"to run without {it}, set {ENV_VAR}={','.join(healthy)} (the plugins that load), or {uninstall}"


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def is_tandem_plugin(info: PluginInfo) -> bool:
    """Whether ``info`` is one of tandem's own plugins: from the tandem-engine distribution
    or, for an entry point with no distribution behind it (tests), one in the tandem package."""
    if info.distribution is not None:
        return info.distribution == TANDEM_DISTRIBUTION
    return info.value.partition(":")[0].split(".")[0] == "tandem"


def _remedy(info: PluginInfo) -> str:
    """How the user gets rid of plugin ``info``."""
    if info.distribution:
        return f"uninstall it (`pip uninstall {info.distribution}`)"
    return f"remove it from the '{ENTRY_POINT_GROUP}' entry points"


class PluginManager:
    """Discovers plugins, registers them with pluggy, and runs their hooks once.

    Strict (the default, what ``LLM(...)`` uses): a broken plugin raises
    ``PluginError``, since running without a plugin the user installed would
    silently change what the engine can serve. Non-strict (``tandem plugins``):
    the failure is kept in ``PluginInfo.error`` and the other plugins load.
    """

    def __init__(self, allow: set[str] | None = None, entry_point_list: list[EntryPoint] | None = None) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.allow = allow
        self._entry_points = entry_point_list
        self.plugins: dict[str, PluginInfo] = {}
        self._objects: dict[str, object] = {}
        self._errors: dict[str, BaseException] = {}  # plugin name -> what broke it, for __cause__

    def broken(self) -> list[str]:
        return [n for n, info in self.plugins.items() if info.error is not None]

    def exclusion_hint(self) -> str:
        return exclusion_hint(list(self.plugins.values()))

    def _fail(self, name: str, message: str, cause: BaseException) -> None:
        self.plugins[name].error = message
        self._errors[name] = cause
        self._objects.pop(name, None)
        if self.pm.has_plugin(name):  # else its hooks would run again, attributed to later plugins
            self.pm.unregister(name=name)

    def _raise_first_failure(self) -> None:
        broken = self.broken()
        if not broken:
            return
        first = self.plugins[broken[0]]
        also = f" (also broken: {', '.join(repr(n) for n in broken[1:])})" if broken[1:] else ""
        raise PluginError(
            f"plugin {first.name!r} ({first.value}) {first.error}{also}; {self.exclusion_hint()}"
        ) from self._errors[first.name]

    def load(self, strict: bool = True) -> None:
        """Import every allowed plugin in the entry-point group; with ``strict``, raise
        ``PluginError`` for the first broken one once all have been tried."""
        eps = self._entry_points
        if eps is None:
            eps = list(entry_points(group=ENTRY_POINT_GROUP))
        for ep in sorted(eps, key=lambda e: e.name):
            if self.allow is not None and ep.name not in self.allow:
                continue
            if ep.name in self.plugins and self.plugins[ep.name].value == ep.value:
                # The same entry point seen twice: a stale *.egg-info beside an install.
                continue
            if ep.name in self.plugins:
                error = PluginError(f"two plugins are named {ep.name!r}: {self.plugins[ep.name].value} and {ep.value}")
                if strict:
                    raise error
                self._fail(ep.name, f"is named twice: {error}", error)
                continue
            dist = getattr(ep, "dist", None)
            self.plugins[ep.name] = PluginInfo(ep.name, ep.value, dist.name if dist is not None else None)
            self._import(ep)
        if self.allow is not None:
            unknown = sorted(self.allow - set(self.plugins))
            if unknown:
                found = sorted(ep.name for ep in eps)
                raise PluginError(f"{ENV_VAR} names unknown plugins {unknown}; installed: {found}")
        if strict:
            self._raise_first_failure()

    def _import(self, ep: EntryPoint) -> None:
        try:
            obj = ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: a plugin calling sys.exit() must not end tandem
            self._fail(ep.name, f"failed to import: {_cause(e)}", e)
            return
        try:
            self.pm.register(obj, name=ep.name)
            self.pm.check_pending()  # a misspelled hook name is an error, not a no-op
        except (pluggy.PluginValidationError, ValueError) as e:  # ValueError: one object, two names
            self._fail(ep.name, f"is invalid: {e}", e)
            return
        self._objects[ep.name] = obj

    def register_all(self, model_registry, backend_registry, strict: bool = True, mode_registry=None) -> None:
        """Call each plugin's hooks, one plugin at a time, so that every
        registration (and every failure) is attributed to its plugin.

        tandem's own plugins run first, then the others in name order: a name registered
        twice without ``override=True`` is then blamed on the plugin that came second, which
        is never tandem's own because a third-party plugin sorts before ``tandem-models``.
        A plugin that fails leaves no registration behind."""
        order = sorted(self._objects, key=lambda n: (not is_tandem_plugin(self.plugins[n]), n))
        for name in order:
            others = [o for n, o in self._objects.items() if n != name]
            before = model_registry.snapshot(), backend_registry.snapshot()
            before_modes = mode_registry.snapshot() if mode_registry is not None else None
            hooks = [("tandem_register_models", model_registry), ("tandem_register_attention_backends", backend_registry)]
            if mode_registry is not None:
                hooks.append(("tandem_register_modes", mode_registry))
            for hook, registry in hooks:
                caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
                with registry.owned_by(name):
                    try:
                        caller(registry=registry)
                    except KeyboardInterrupt:
                        raise
                    except DuplicateRegistrationError as e:  # the message names both plugins
                        self._fail(name, f"failed in {hook}: {e}, or {_remedy(self.plugins[name])}", e)
                    except BaseException as e:  # SystemExit too, as for imports
                        self._fail(name, f"failed in {hook}: {_cause(e)}", e)
                if name not in self._objects:
                    model_registry.restore(before[0])
                    backend_registry.restore(before[1])
                    if mode_registry is not None:
                        mode_registry.restore(before_modes)
                    if strict:
                        self._raise_first_failure()
                    break  # broken: its other hook is not called
        for name, info in self.plugins.items():
            if mode_registry is not None:
                info.modes = [n for n in mode_registry.names() if mode_registry.owner(n) == name]
            info.models = [n for n in model_registry.names() if model_registry.owner(n) == name]
            info.backends = [n for n in backend_registry.names() if backend_registry.owner(n) == name]
