"""The process-wide registries, filled once from the ``tandem.plugins`` entry points.

Entry points (``LLM``, the CLI) build them here and hand them to the engine; the
registry package knows nothing of plugins.
"""

from __future__ import annotations

from tandem.plugins.manager import PluginManager, allowed_plugins
from tandem.registry import AttentionBackendRegistry, ModelRegistry, ModeRegistry

_model_registry: ModelRegistry | None = None
_backend_registry: AttentionBackendRegistry | None = None
_mode_registry: ModeRegistry | None = None
_plugin_manager = None


def _populate() -> None:
    """Load the ``tandem.plugins`` entry points once per process and run their hooks.

    Strict: a broken plugin raises ``PluginError`` rather than the engine running without it."""
    global _model_registry, _backend_registry, _mode_registry, _plugin_manager
    manager = PluginManager(allow=allowed_plugins())
    manager.load()
    models, backends, modes = ModelRegistry(), AttentionBackendRegistry(), ModeRegistry()
    manager.register_all(models, backends, mode_registry=modes)
    _model_registry, _backend_registry, _mode_registry, _plugin_manager = models, backends, modes, manager


def default_model_registry() -> ModelRegistry:
    """The process-wide model registry, filled by the plugins on first use."""
    if _model_registry is None:
        _populate()
    return _model_registry


def default_backend_registry() -> AttentionBackendRegistry:
    """The process-wide attention-backend registry, filled by the plugins on first use."""
    if _backend_registry is None:
        _populate()
    return _backend_registry


def default_mode_registry() -> ModeRegistry:
    """The process-wide mode registry: tandem's modes and the plugins' (first use fills it)."""
    if _mode_registry is None:
        _populate()
    return _mode_registry


def plugin_manager():
    """The PluginManager that filled the default registries."""
    if _plugin_manager is None:
        _populate()
    return _plugin_manager


def plugin_report(entry_point_list=None) -> list:
    """Every allowed plugin as a ``PluginInfo``, broken ones included with their ``error``.

    Loads into fresh registries without raising for a broken plugin (``tandem plugins``
    shows them all); the default registries are neither filled nor changed. An unknown
    name in ``$TANDEM_PLUGINS`` still raises ``PluginError``.
    """
    manager = PluginManager(allow=allowed_plugins(), entry_point_list=entry_point_list)
    manager.load(strict=False)
    backends = AttentionBackendRegistry()
    manager.register_all(ModelRegistry(), backends, strict=False)
    infos = list(manager.plugins.values())
    device, dtype, _ = auto_target()
    for info in infos:
        for name in info.backends:
            info.backend_capabilities[name] = _capabilities(backends, name, device, dtype)
    return infos


def auto_target():
    """The device and dtype an engine gets here with ``device="auto"`` and
    ``dtype="auto"`` (core/dtype.py; on a GPU, where the dtype is the checkpoint's,
    bfloat16), with the reason: what ``tandem plugins`` checks each backend against.
    A bad ``$TANDEM_AUTO_DTYPE`` is named in the reason, and float32 shown."""
    import torch

    from tandem.core.dtype import resolve_auto_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dtype, why = resolve_auto_dtype(None, device)
    except ValueError as e:  # the listing still runs; an engine would refuse this
        dtype, why = torch.float32, f"float32 shown, but an engine would refuse: {e}"
    return device, dtype, why


def _capabilities(registry: AttentionBackendRegistry, name: str, device, dtype) -> dict[str, str]:
    """What ``name`` serves, and whether it can serve here: on ``device``/``dtype``
    (``auto_target()``), head size 64, block size 16, all attention kinds."""
    from tandem.core.attention import AttentionType

    try:
        backend = registry.load(name)
    except Exception as e:  # a broken backend is reported, not raised: the listing goes on
        return {"error": f"{type(e).__name__}: {e}"}
    lines = backend.capabilities.describe() if backend.capabilities else {"capabilities": "not described"}
    reasons = backend.unsupported_reasons(device, dtype, 64, frozenset(AttentionType), 16, dtype)
    where = f"{device.type}/{str(dtype).removeprefix('torch.')}, head size 64, block size 16"
    auto = backend.auto_priority(device, dtype)
    if reasons:
        lines["here"] = f"cannot serve {where}: {'; '.join(reasons)}"
    else:
        chosen = f"auto priority {auto}" if auto is not None else "only when asked for by name"
        lines["here"] = f"can serve {where} ({chosen})"
    return lines


def reset_registries() -> None:
    """Forget the plugins and their registrations; the next use loads them again."""
    global _model_registry, _backend_registry, _mode_registry, _plugin_manager
    _model_registry = _backend_registry = _mode_registry = _plugin_manager = None
