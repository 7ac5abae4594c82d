"""Block tables that persist across steps.

The scheduler sends a sequence's whole block table once and afterwards only
the block ids appended since (usually none: a decode step fills a slot of a
block it already holds). Each sequence keeps a row of a preallocated table
tensor; a step gathers the rows it runs with one ``index_select`` instead of
padding Python lists into a new tensor.
"""

from __future__ import annotations

import torch


class BlockTableRows:
    """Rows of block ids, one per key (a sequence id, or a request's cross table)."""

    def __init__(self, initial_rows: int, initial_width: int) -> None:
        self.table = torch.zeros(max(1, initial_rows), max(1, initial_width), dtype=torch.long)
        self.width: list[int] = []  # ids held by each row
        self._row: dict[object, int] = {}
        self._free_rows: list[int] = list(range(self.table.shape[0] - 1, -1, -1))
        self.width = [0] * self.table.shape[0]

    def __contains__(self, key: object) -> bool:
        return key in self._row

    def row(self, key: object) -> int:
        return self._row[key]

    def rows(self, keys) -> list[int]:
        """The rows of ``keys``, in order (one call per step, not one per key)."""
        row = self._row
        return [row[k] for k in keys]

    def keys(self):
        """The keys held (a live view: membership tests cost no Python call)."""
        return self._row.keys()

    def lengths(self, keys) -> list[int]:
        """Ids held by each key's row, -1 for a key not held (one call per step)."""
        row, width = self._row, self.width
        return [width[row[k]] if k in row else -1 for k in keys]

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        new_rows, new_width = max(old_rows, rows), max(old_width, width)
        if (new_rows, new_width) == (old_rows, old_width):
            return
        grown = torch.zeros(new_rows, new_width, dtype=torch.long)
        grown[:old_rows, :old_width] = self.table
        self.table = grown
        self._free_rows = list(range(new_rows - 1, old_rows - 1, -1)) + self._free_rows
        self.width += [0] * (new_rows - old_rows)

    def set(self, key: object, block_ids: list[int]) -> None:
        """Replace the key's row (adding the key if new)."""
        row = self._row.get(key)
        if row is None:
            if not self._free_rows:
                self._grow(2 * self.table.shape[0], 0)
            row = self._row[key] = self._free_rows.pop()
        n = len(block_ids)
        if n > self.table.shape[1]:
            self._grow(0, max(n, 2 * self.table.shape[1]))
        if n:
            self.table[row, :n] = torch.tensor(block_ids, dtype=torch.long)
        self.width[row] = n

    def set_many(self, keys: list, id_lists: list[list[int]]) -> None:
        """``set(key, ids)`` for each pair, as one tensor write (keys distinct): the same
        rows (taken in order) and the same table shape as the calls one by one."""
        row_of, free = self._row, self._free_rows
        rows = []
        for key in keys:
            row = row_of.get(key)
            if row is None:
                if not free:
                    self._grow(2 * self.table.shape[0], 0)
                    free = self._free_rows
                row = row_of[key] = free.pop()
            rows.append(row)
        cols = self.table.shape[1]
        for ids in id_lists:  # widened as set would, call by call
            if len(ids) > cols:
                cols = max(len(ids), 2 * cols)
        self._grow(0, cols)
        width, r, c, values = self.width, [], [], []
        for row, ids in zip(rows, id_lists):
            n = len(ids)
            width[row] = n
            r += [row] * n
            c += range(n)
            values += ids
        if values:
            self.table[torch.tensor(r), torch.tensor(c)] = torch.tensor(values, dtype=torch.long)

    def extend(self, key: object, block_ids: list[int]) -> None:
        """Append ids to the key's row."""
        if not block_ids:
            return
        row = self._row[key]
        start = self.width[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(0, max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.long)
        self.width[row] = end

    def extend_many(self, keys: list, id_lists: list[list[int]]) -> None:
        """``extend(key, ids)`` for each pair, as one tensor write (keys distinct)."""
        row_of, width = self._row, self.width
        if len(keys) == len(id_lists) and [len(ids) for ids in id_lists].count(1) == len(keys):
            # One id each (a decode step): no per-id lists to build.
            if not keys:
                return
            rows = [row_of[k] for k in keys]
            cols = [width[r] for r in rows]
            for r, c in zip(rows, cols):
                width[r] = c + 1
            end_max = max(cols) + 1
            if end_max > self.table.shape[1]:
                self._grow(0, max(end_max, 2 * self.table.shape[1]))
            self.table[torch.tensor(rows), torch.tensor(cols)] = torch.tensor([ids[0] for ids in id_lists],
                                                                              dtype=torch.long)
            return
        rows, cols, values = [], [], []
        end_max = 0
        for key, ids in zip(keys, id_lists):
            row = row_of[key]
            start = width[row]
            end = start + len(ids)
            width[row] = end
            end_max = max(end_max, end)
            rows.extend([row] * len(ids))
            cols.extend(range(start, end))
            values.extend(ids)
        if not values:
            return
        if end_max > self.table.shape[1]:
            self._grow(0, max(end_max, 2 * self.table.shape[1]))
        self.table[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(values, dtype=torch.long)

    def copy_rows(self, src_keys: list, dst_keys: list, lengths: list[int] | None = None) -> None:
        """Each ``dst_keys[i]``'s row (added if new) becomes ``src_keys[i]``'s as it was
        before the call, its first ``lengths[i]`` ids (None: all), in one tensor copy."""
        row_of, width = self._row, self.width
        src_rows = [row_of[k] for k in src_keys]
        src_widths = [width[r] for r in src_rows]
        for key in dst_keys:
            if key not in row_of:
                if not self._free_rows:
                    self._grow(2 * self.table.shape[0], 0)
                row_of[key] = self._free_rows.pop()
        dst_rows = [row_of[k] for k in dst_keys]
        self.table[torch.tensor(dst_rows, dtype=torch.long)] = self.table[torch.tensor(src_rows, dtype=torch.long)]
        for r, w in zip(dst_rows, src_widths if lengths is None else lengths):
            width[r] = w

    def get(self, key: object) -> list[int]:
        row = self._row[key]
        return self.table[row, : self.width[row]].tolist()

    def remove(self, key: object) -> None:
        row = self._row.pop(key, None)
        if row is not None:
            self.width[row] = 0
            self._free_rows.append(row)

    def gather(self, rows: torch.Tensor, num_cols: int) -> torch.Tensor:
        """``[len(rows), num_cols]``: the rows' leading ids (columns past a row's own
        ids hold stale ids, which callers mask by length)."""
        return self.table[:, : max(1, num_cols)].index_select(0, rows)
