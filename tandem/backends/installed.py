"""What is installed, asked without importing it: the kernel libraries' capability
checks (flash_attn, xformers) must not import their CUDA packages to answer."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path


def dist_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_dirs(package: str) -> list[Path]:
    """Where top-level package ``package`` would import from, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a broken or half-imported parent
        return []
    return [Path(p) for p in (spec.submodule_search_locations or ())] if spec is not None else []
