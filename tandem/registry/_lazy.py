"""A small name -> lazily imported class registry."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

logger = logging.getLogger("tandem.registry")


def import_object(path: str) -> Any:
    """Import ``"package.module:Name"``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form 'package.module:Name'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from None


def _describe(target: Any) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


class DuplicateRegistrationError(ValueError):
    """A name registered again without ``override=True``. The registration that came second
    is the one refused: ``owner`` made it (a plugin name, None for a direct call), and
    ``first_owner`` holds the name."""

    def __init__(self, message: str, name: str, owner: str | None, first_owner: str | None) -> None:
        super().__init__(message)
        self.name, self.owner, self.first_owner = name, owner, first_owner


class LazyRegistry(Generic[T]):
    """Maps names to classes or ``"module:Class"`` paths imported on first use."""

    kind = "entry"

    def __init__(self) -> None:
        self._entries: dict[str, str | type[T]] = {}
        self._loaded: dict[str, type[T]] = {}
        self._owners: dict[str, str | None] = {}
        self._overrides: dict[str, bool] = {}
        self._current_owner: str | None = None

    @contextlib.contextmanager
    def owned_by(self, owner: str) -> Iterator[None]:
        """Attribute registrations made inside the block to ``owner`` (a plugin name)."""
        if self._current_owner is not None:
            raise RuntimeError(f"registrations are already attributed to {self._current_owner!r}")
        self._current_owner = owner
        try:
            yield
        finally:
            self._current_owner = None

    def snapshot(self) -> tuple:
        """The registrations as they stand, for :meth:`restore`."""
        return dict(self._entries), dict(self._loaded), dict(self._owners), dict(self._overrides)

    def restore(self, state: tuple) -> None:
        """Undo every registration made since :meth:`snapshot` returned ``state`` (a plugin
        that failed part of the way through its hook leaves nothing behind)."""
        self._entries, self._loaded, self._owners, self._overrides = (dict(d) for d in state)

    def owner(self, name: str) -> str | None:
        """The plugin that registered ``name`` (None when registered directly)."""
        return self._owners.get(name)

    def register(self, name: str, target: str | type[T], *, override: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if isinstance(target, str):
            if ":" not in target:
                raise ValueError(f"{self.kind} {name!r}: {target!r} is not 'package.module:Class'")
        elif not isinstance(target, type):
            raise TypeError(f"{self.kind} {name!r}: expected a class or 'module:Class', got {target!r}")
        new_owner, old_owner = self._who(self._current_owner), self._who(self._owners.get(name))
        if name in self._entries and not override:
            if self._overrides.get(name):
                # An explicit override wins whichever plugin ran first; say which one lost.
                logger.warning(
                    "%s %r: %s registered %s, ignored: %s overrides it with %s (override=True)",
                    self.kind, name, new_owner, _describe(target), old_owner, self._describe(name),
                )
                return
            raise DuplicateRegistrationError(
                f"{self.kind} {name!r} is registered twice: by {old_owner} "
                f"({self._describe(name)}) and by {new_owner} "
                f"({_describe(target)}); {new_owner} must pass override=True to replace it",
                name, self._current_owner, self._owners.get(name),
            )
        if name in self._entries:  # an override replacing a built-in or another plugin's entry
            logger.warning(
                "%s %r: %s overrides it with %s, replacing %s registered by %s",
                self.kind, name, new_owner, _describe(target), self._describe(name), old_owner,
            )
        self._entries[name] = target
        self._owners[name] = self._current_owner
        self._overrides[name] = override
        self._loaded.pop(name, None)

    @staticmethod
    def _who(owner: str | None) -> str:
        return f"plugin {owner!r}" if owner else "a direct call"

    def _describe(self, name: str) -> str:
        return _describe(self._entries[name])

    def origin(self, name: str) -> str:
        """``"<kind> '<name>' (registered by plugin '<owner>')"``, for errors about an entry."""
        return f"{self.kind} {name!r} (registered by {self._who(self._owners.get(name))})"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def load(self, name: str) -> type[T]:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or 'none'}")
        if name not in self._loaded:
            target = self._entries[name]
            if isinstance(target, str):
                try:
                    self._loaded[name] = import_object(target)
                except ImportError as e:
                    raise ImportError(f"{self.origin(name)}: cannot import {target!r}: {e}") from e
            else:
                self._loaded[name] = target
        return self._loaded[name]
