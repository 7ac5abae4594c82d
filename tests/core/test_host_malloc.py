"""cpu_malloc: glibc keeps freed memory for reuse, unless someone chose otherwise.

The oracle for "kept" is the kernel's own count of minor page faults: a freshly
mmapped 64 MiB tensor faults in every one of its 16384 4-KiB pages on first
touch; one carved from memory glibc kept faults in (almost) none."""

import json
import os
import subprocess
import sys

import pytest
from tandem.core.config import EngineConfig
from tandem.core.worker import host_malloc
from tandem.core.worker.host_malloc import keep_freed_memory

# A fresh interpreter: in a process that has built and dropped engines, glibc's
# free lists hold blocks that were never written, and those fault in on first use
# however glibc is set.
_PROBE = """
import json, resource, sys
import torch
# Laid out as an engine process is (its worker's modules loaded) before measuring: in a
# bare interpreter that has imported torch and this module alone, glibc's heap could not
# keep the freed 64 MiB in about half of the runs here (the old worker/__init__ imported
# the worker; since it stopped, this probe measured a process no engine runs in).
import tandem.core.worker.worker  # noqa: F401
from tandem.core.worker.host_malloc import keep_freed_memory

SIZE = 64 << 20  # over glibc's largest mmap threshold (32 MiB): mmapped unless told otherwise

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(SIZE // 4, dtype=torch.float32).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = min(faults() for _ in range(3))
said = keep_freed_memory("auto", environ={})
faults()  # the first one grows the heap
kept = min(faults() for _ in range(3))
print(json.dumps({"default": default, "kept": kept, "said": said, "pages": SIZE // 4096}))
"""


@pytest.mark.skipif(host_malloc._glibc() is None, reason="glibc only")
def test_auto_keeps_freed_memory_for_reuse():
    # Without the settings that make "auto" step aside.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", *host_malloc._ENV_SETTINGS)}
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert "freed memory kept" in r["said"]
    # Default glibc mmaps the tensor afresh each time: every 4 KiB page faults (16384),
    # unless transparent huge pages back it (2 MiB faults), so that half is checked only
    # without THP. Kept: a reused heap block needs (almost) none. Bar: 1/8 of the pages.
    if "[always]" not in _read("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert r["default"] > r["pages"] // 2, r
    assert r["kept"] < r["pages"] // 8, r


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def test_other_choices_are_left_alone():
    assert "jemalloc" in keep_freed_memory("auto", environ={"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})
    assert "MALLOC_MMAP_MAX_" in keep_freed_memory("auto", environ={"MALLOC_MMAP_MAX_": "65536"})
    assert "system" in keep_freed_memory("system")


def test_bad_value_is_refused_by_name(bart_dir):
    with pytest.raises(ValueError, match="cpu_malloc='jemalloc'"):
        keep_freed_memory("jemalloc")
    with pytest.raises(ValueError, match="cpu_malloc='fast'"):
        EngineConfig(model=str(bart_dir), cpu_malloc="fast")
