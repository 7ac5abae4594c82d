"""The decoder tokens of the sequences whose logits processors read them.

Each such sequence keeps a row of a preallocated table (``BlockTableRows``) that
grows by the tokens each step computes. A steady decode step (the same sequences
as the last step, in the same order, each computing one token right after the
ones its row holds) writes every row's token with one tensor write at columns
kept as a tensor between steps, and gives the processors the table in place with
row and length tensors also kept (``view``), so neither builds a tensor from a
per-row list nor gathers the rows. Any other step, and any other change to the
rows (a sequence added, copied, recomputed or removed), takes the general path
and starts the kept state over.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.core.worker.input_batch import BlockTableRows


@dataclass
class _Steady:
    """The rows the last ``record`` wrote, in its order, and their lengths after it."""

    seq_ids: list[int]
    rows: list[int]  # their table rows
    rows_t: torch.Tensor
    lengths: list[int]  # tokens each row holds
    lengths_t: torch.Tensor
    max_length: int
    synced: bool  # whether BlockTableRows.width holds ``lengths`` yet


class TokenHistories(BlockTableRows):
    """Token rows by sequence id, with a steady-step fast path (module docstring). Every
    ``BlockTableRows`` method keeps working; those that change rows end the fast path's
    kept state (the next ``record`` takes the general path and keeps it again)."""

    def __init__(self, initial_rows: int, initial_width: int) -> None:
        super().__init__(initial_rows, initial_width)
        self._steady: _Steady | None = None

    # -- the step's tokens ---------------------------------------------------------
    def record(self, seqs, one_by_one: Callable[[object], None]) -> None:
        """Add each scheduled sequence's ``token_ids`` (computed this step, at position
        ``num_computed_tokens``) to its row; a sequence computed from its start (new, or
        recomputed whole) gets a row of its tokens. Any other whose row does not hold
        exactly its first ``num_computed_tokens`` tokens (forked with
        ``prefix_token_ids``, recomputed in part) is passed to ``one_by_one``, which
        sets its row."""
        ids = [s.seq_id for s in seqs]
        st = self._steady
        if st is not None and ids == st.seq_ids and [s.num_computed_tokens for s in seqs] == st.lengths:
            try:  # one token each: unpacking a one-element list, a ValueError otherwise
                tokens = [t for s in seqs for (t,) in (s.token_ids,)]
            except ValueError:
                tokens = None
            if tokens is not None and [s.prefix_token_ids for s in seqs].count(None) == len(ids):
                self._write_steady(st, tokens)
                return
        self._invalidate()
        keys, id_lists, fresh, fresh_ids = [], [], [], []
        for seq, held in zip(seqs, self.lengths(ids)):
            if seq.prefix_token_ids is None and held == seq.num_computed_tokens:
                keys.append(seq.seq_id)
                id_lists.append(seq.token_ids)
            elif seq.prefix_token_ids is None and seq.num_computed_tokens == 0:  # new, or recomputed whole
                fresh.append(seq.seq_id)
                fresh_ids.append(seq.token_ids)
            else:
                one_by_one(seq)
        self.extend_many(keys, id_lists)
        if fresh:  # one tensor write (the first step of a batch of new requests)
            self.set_many(fresh, fresh_ids)
        if ids and len(set(ids)) == len(ids):
            rows = self.rows(ids)
            width = self.width
            lengths = [width[r] for r in rows]
            self._steady = _Steady(ids, rows, torch.tensor(rows, dtype=torch.long), lengths,
                                   torch.tensor(lengths, dtype=torch.long), max(lengths), True)

    def _write_steady(self, st: _Steady, tokens: list[int]) -> None:
        """One token at the end of each of the kept rows, in their order."""
        end = st.max_length + 1
        if end > self.table.shape[1]:
            self._grow(0, max(end, 2 * self.table.shape[1]))
        # From an int64 array: a third of torch.tensor's time on a list of ints.
        self.table[st.rows_t, st.lengths_t] = torch.frombuffer(array("q", tokens), dtype=torch.long)
        st.lengths = [n + 1 for n in st.lengths]
        st.lengths_t = st.lengths_t + 1  # a new tensor: one handed out earlier keeps its values
        st.max_length = end
        st.synced = False

    def advance(self, seq_ids: list[int], tokens: list[int]) -> None:
        """One more token at the end of each sequence's row (a run's next step,
        ``core/sched/multi_step.py``): the steady write when they are the last record's
        rows, in its order; else ``extend_many``."""
        st = self._steady
        if st is not None and seq_ids == st.seq_ids:
            self._write_steady(st, tokens)
        else:
            self.extend_many(seq_ids, [[t] for t in tokens])

    def view(self, seq_ids: list[int], lengths: list[int], idx: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(table, table_rows, lengths)`` for rows ``idx`` (distinct, ascending) of a step
        whose rows are the sequences ``seq_ids`` (one entry per row) at ``lengths`` tokens:
        row ``idx[j]``'s tokens are ``table[table_rows[j], :lengths[j]]``. The table is read
        in place (columns past a row's length hold stale ids); on a steady step whose rows
        are the last record's, every tensor is the kept one."""
        st = self._steady
        if (st is not None and len(idx) == len(seq_ids) and seq_ids == st.seq_ids
                and lengths == st.lengths):
            return self.table, st.rows_t, st.lengths_t
        if len(idx) == len(seq_ids):
            ids, lens = seq_ids, lengths
        else:
            ids, lens = [seq_ids[i] for i in idx], [lengths[i] for i in idx]
        return (self.table, torch.tensor(self.rows(ids), dtype=torch.long),
                torch.tensor(lens, dtype=torch.long))

    # -- the kept state against BlockTableRows' own methods ------------------------
    def _sync(self) -> None:
        """Write the fast path's lengths into ``width`` (left behind on steady steps)."""
        st = self._steady
        if st is not None and not st.synced:
            width = self.width
            for r, n in zip(st.rows, st.lengths):
                width[r] = n
            st.synced = True

    def _invalidate(self) -> None:
        self._sync()
        self._steady = None

    def lengths(self, keys) -> list[int]:
        self._sync()
        return super().lengths(keys)

    def get(self, key: object) -> list[int]:
        self._sync()
        return super().get(key)

    def set(self, key: object, block_ids: list[int]) -> None:
        self._invalidate()
        super().set(key, block_ids)

    def set_many(self, keys: list, id_lists: list[list[int]]) -> None:
        self._invalidate()
        super().set_many(keys, id_lists)

    def extend(self, key: object, block_ids: list[int]) -> None:
        self._invalidate()
        super().extend(key, block_ids)

    def extend_many(self, keys: list, id_lists: list[list[int]]) -> None:
        self._invalidate()
        super().extend_many(keys, id_lists)

    def copy_rows(self, src_keys: list, dst_keys: list, lengths: list[int] | None = None) -> None:
        self._invalidate()
        super().copy_rows(src_keys, dst_keys, lengths)

    def remove(self, key: object) -> None:
        self._invalidate()
        super().remove(key)
