"""Ray Data batches as rows of plain Python values, and back.

A batch arrives as a dict of columns (numpy arrays, Ray Data's default format) or
a pandas DataFrame (``batch_format="pandas"``); either comes back in its own form
with the output columns added. Arrow hands nested values over as numpy: a struct
column as dicts (a key one row lacks is ``None`` there), a list column as arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def plain(value: Any) -> Any:
    """``value`` with numpy taken out where a prompt needs Python values: integer
    arrays become lists of ints (token ids), numpy scalars Python scalars, dicts
    lose their ``None`` entries (keys other rows of a struct column have). Float
    arrays stay arrays (audio samples)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return [plain(v) for v in value.tolist()]
        if np.issubdtype(value.dtype, np.integer) or value.dtype == np.bool_:
            return value.tolist()
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def columns(batch: Any) -> tuple[dict[str, Any], bool]:
    """The batch's columns by name, and whether it was a pandas DataFrame."""
    if isinstance(batch, dict):
        return batch, False
    if hasattr(batch, "columns") and hasattr(batch, "to_dict"):  # pandas, without importing it
        return {name: batch[name].to_numpy() for name in batch.columns}, True
    raise TypeError(f"a Ray Data batch must be a dict of columns or a pandas DataFrame (batch_format 'numpy' or "
                    f"'pandas'), got {type(batch).__name__}")


def column(cols: dict[str, Any], name: str, what: str) -> Any:
    """Column ``name``; a missing one is a ``KeyError`` naming the option and the columns there are."""
    if name not in cols:
        raise KeyError(f"the batch has no column {name!r} ({what}); its columns: {sorted(cols)}")
    return cols[name]


def object_column(values: list) -> np.ndarray:
    """A 1-D object array of ``values`` (lists stay elements, never a second axis)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def with_columns(batch: Any, was_pandas: bool, new: dict[str, list]) -> Any:
    """The input batch plus the ``new`` columns (one value per row), in the input's form."""
    if was_pandas:
        out = batch.copy()
        for name, values in new.items():
            out[name] = object_column(values)
        return out
    out = dict(batch)
    for name, values in new.items():
        out[name] = object_column(values)
    return out
