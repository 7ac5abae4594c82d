"""A prompt's ``prompt_token_ids`` are plain ints: the check that reads their types in C
(``InputProcessor._singleton``) accepts and refuses what the per-id check did."""

from __future__ import annotations

import enum

import numpy as np
import pytest

from tandem.core.inputs import InputProcessor


class _Id(enum.IntEnum):
    A = 5


class _Model:
    @classmethod
    def max_encoder_len(cls, config) -> int:
        return 100

    @classmethod
    def max_decoder_len(cls, config) -> int:
        return 100


def _per_id(ids) -> bool:
    return isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


@pytest.mark.parametrize("ids", [[], [1, 2, 3], (4, 5), [1, _Id.A], [True], [1, False], [1.0], [np.int64(3)],
                                 [1, "2"], [None], "123", {1, 2}, [[1]]])
def test_ids_accepted_as_the_per_id_check_does(ids):
    proc = InputProcessor(None, _Model, None)
    if _per_id(ids):
        got, _ = proc._singleton({"prompt_token_ids": ids}, "prompt", True)
        assert got == list(ids) and type(got) is list
    else:
        with pytest.raises(ValueError, match="must be a list of ints"):
            proc._singleton({"prompt_token_ids": ids}, "prompt", True)
