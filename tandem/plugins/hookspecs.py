"""Every hook tandem calls, in one place.

Plugins implement these with ``@tandem.plugins.hookimpl`` on functions of a
module (or methods of an object) named by an entry point in the
``tandem.plugins`` group. tandem's own models and backends use the same path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from tandem.registry import AttentionBackendRegistry, ModelRegistry, ModeRegistry

PROJECT = "tandem"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def tandem_register_models(registry: "ModelRegistry") -> None:
    """Register model classes for architectures named in ``config.json``.

    :param registry: call ``registry.register_model(architecture, target)``
        where ``target`` is a class or a lazily imported
        ``"package.module:Class"`` subclassing
        ``tandem.EncoderDecoderModel``. Registering an architecture another
        plugin registered is an error unless ``override=True`` is passed;
        an override that replaces another registration is logged as a
        warning on ``tandem.registry`` naming both plugins.
    :return: nothing; every plugin's implementation is called (not
        ``firstresult``).
    """


@hookspec
def tandem_register_attention_backends(registry: "AttentionBackendRegistry") -> None:
    """Register attention backends by name.

    :param registry: call ``registry.register_backend(name, target)`` where
        ``target`` is a ``tandem.AttentionBackend`` subclass or a lazily
        imported ``"package.module:Class"`` whose ``name`` class attribute
        equals ``name`` (checked when it is loaded). Keep heavy imports (triton,
        CUDA libraries) out of the plugin module: the target is imported only
        when the backend is selected. Duplicate names are an error unless
        ``override=True`` (logged as a warning, as for models).
    :return: nothing; every plugin's implementation is called (not
        ``firstresult``).
    """


@hookspec
def tandem_register_modes(registry: "ModeRegistry") -> None:
    """Register request modes (docs/architecture.md, "Adding a mode").

    :param registry: call ``registry.register_mode(name, target)`` where
        ``target`` is a ``tandem.core.strategies.modes.Mode`` subclass or a
        lazily imported ``"package.module:Class"`` whose ``name`` class
        attribute equals ``name``. Every engine then builds one instance of it
        and asks it, for each request, whether it ``applies`` and for the
        request's strategy; which modes combine is declared on the class
        (``excludes``, ``yields_to``). Duplicate names (tandem's own
        ``sampling``, ``beam_search``, ``speculative``, ``structured_output``,
        ``prompt_slot`` included) are an error unless ``override=True``.
    :return: nothing; every plugin's implementation is called (not
        ``firstresult``).
    """
