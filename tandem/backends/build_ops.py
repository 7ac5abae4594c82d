"""``python -m tandem.backends.build_ops``: build (or load) tandem's C++ CPU ops for this
machine ahead of the first engine start (a Dockerfile step, a CI cache warm-up) and
print where each library is, or why it is not built: cpu_paged's decode attention,
cpu_flash's bf16 encoder attention and cpu_sampling's argmax. Exit 1 where cpu_paged's
op, which every CPU with a compiler can run, is unavailable.

The build is the one an engine start runs (``cpp_build``: one directory per source,
flags and torch version, under a lock that dies with its holder), so a later start
loads these libraries without compiling."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path


def _library(prefix: str) -> str:
    import torch

    found = [p for p in torch.ops.loaded_libraries if Path(p).name.startswith(prefix)]
    return found[0] if found else "(loaded)"


def main() -> int:
    from tandem.backends.cpu_flash import ops as flash_ops
    from tandem.backends.cpu_paged import ops as paged_ops
    from tandem.backends.cpu_sampling import ops as sampling_ops
    from tandem.logger import configure_cli_logging

    configure_cli_logging()  # the build's start and done lines, at INFO
    status = 0
    for name, module, prefix in (("cpu_paged", paged_ops, paged_ops.library_name()),
                                 ("cpu_flash", flash_ops, flash_ops.NAME),
                                 ("cpu_sampling", sampling_ops, sampling_ops.library_name())):
        started = time.perf_counter()
        try:
            module.load()
        except module.CPUOpUnavailable as e:
            print(f"{name}: not built: {e}")
            status = status or int(name == "cpu_paged")
            continue
        print(f"{name}: {_library(prefix)} ({time.perf_counter() - started:.1f} s)")
    return status


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
