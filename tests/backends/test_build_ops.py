"""``python -m tandem.backends.build_ops``: builds the ops ahead of a start and says where
they are or why not; exit 1 only where cpu_paged's op is unavailable. (The build itself:
test_cpp_build.py; here the loads are stubbed.)"""

from __future__ import annotations

import pytest

from tandem.backends import build_ops
from tandem.backends.cpu_flash import ops as flash_ops
from tandem.backends.cpu_paged import ops as paged_ops


def _unavailable(cls, why):
    def load():
        raise cls(why)
    return load


@pytest.mark.parametrize("paged_ok, status", [(True, 0), (False, 1)])
def test_build_ops_reports_each_op_and_fails_only_without_cpu_paged(monkeypatch, capsys, paged_ok, status):
    monkeypatch.setattr(paged_ops, "load", (lambda: object()) if paged_ok
                        else _unavailable(paged_ops.CPUOpUnavailable, "no C++ compiler ('c++' is not on PATH)"))
    monkeypatch.setattr(flash_ops, "load", _unavailable(flash_ops.CPUOpUnavailable, "the CPU lacks avx512_bf16"))
    assert build_ops.main() == status
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "cpu_flash: not built: the CPU lacks avx512_bf16"
    if paged_ok:
        assert out[0].startswith("cpu_paged: ") and out[0].endswith(" s)")
    else:
        assert out[0] == "cpu_paged: not built: no C++ compiler ('c++' is not on PATH)"
