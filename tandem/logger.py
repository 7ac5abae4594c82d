"""tandem's logging: one ``tandem`` logger, its level from ``$TANDEM_LOGGING_LEVEL``.

Embedded in a service, tandem adds no handler of its own: records propagate to
whatever the host configured, and with nothing configured only warnings reach
stderr (Python's last-resort handler). ``$TANDEM_LOGGING_LEVEL`` sets the
level either way; when the host configured nothing, tandem then prints to
stderr itself so the level is honoured. The CLI logs at INFO by default.
"""

from __future__ import annotations

import logging
import os
import sys

ENV_VAR = "TANDEM_LOGGING_LEVEL"
_FORMAT = "%(levelname)s %(name)s: %(message)s"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger("tandem")


def _env_level() -> int | None:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    if raw.upper() not in _LEVELS:
        raise ValueError(f"{ENV_VAR}={raw!r}: must be one of {', '.join(_LEVELS)}")
    return getattr(logging, raw.upper())


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not to the stream
    it was when the handler was made: a host (or a test) that swaps ``sys.stderr`` and
    closes the old one never leaves tandem logging into a closed file."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _add_stderr_handler() -> None:
    if not any(getattr(h, "_tandem", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._tandem = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.propagate = False


def configure_library_logging() -> None:
    """Called on ``import tandem``: honour ``$TANDEM_LOGGING_LEVEL``, else leave the host in charge.

    A bad value is reported as a warning, not raised: an import must not fail over logging."""
    try:
        level = _env_level()
    except ValueError as e:
        logger.warning("%s; ignoring it", e)
        return
    if level is None:
        return
    logger.setLevel(level)
    if not logging.getLogger().handlers:
        _add_stderr_handler()


def configure_cli_logging() -> None:
    """The CLI's logging: INFO (or ``$TANDEM_LOGGING_LEVEL``) to stderr."""
    level = _env_level()
    logger.setLevel(logging.INFO if level is None else level)
    _add_stderr_handler()
