"""Memory the machine has left, and the check that a pool fits in it."""

from __future__ import annotations

import psutil
import torch

GiB = 1 << 30


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def check_fits(what: str, nbytes: int, device: torch.device, hint: str) -> None:
    """Raise ``ValueError`` naming ``what`` when ``nbytes`` exceed what ``device`` has free."""
    avail = available_bytes(device)
    if nbytes > avail:
        where = "this machine's RAM" if device.type == "cpu" else str(device)
        raise ValueError(
            f"{what} needs {nbytes / GiB:.2f} GiB but {where} has {avail / GiB:.2f} GiB available; {hint}"
        )
