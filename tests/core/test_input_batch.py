"""The worker's persistent block-table rows against a dict-of-lists oracle."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.worker.input_batch import BlockTableRows

ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "extend", "remove", "copy", "extend_many", "set_many"]),
        st.integers(0, 9),  # key
        st.lists(st.integers(0, 10_000), max_size=12),  # block ids
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 4), st.integers(1, 4))
def test_rows_hold_exactly_what_was_set_and_appended(operations, rows, width):
    table, oracle = BlockTableRows(rows, width), {}
    for op, key, ids in operations:
        if op == "set":
            table.set(key, ids)
            oracle[key] = list(ids)
        elif op == "extend" and key in oracle:
            table.extend(key, ids)
            oracle[key] += ids
        elif op == "extend_many" and oracle:
            # Several held keys at once: one id each (a decode step's write) when the key
            # is even, else each its own slice of ids (none, one or more).
            keys = sorted(oracle)[key % 3:]
            if key % 2 == 0 or not ids:
                lists = [[(ids[0] if ids else 7) + j] for j in range(len(keys))]
            else:
                lists = [ids[j % len(ids):] for j in range(len(keys))]
            table.extend_many(keys, lists)
            for k, more in zip(keys, lists):
                oracle[k] += more
        elif op == "set_many":
            # Keys held or new, each its own slice of ids (none, one or more); the same
            # calls one by one on a twin give the same rows, widths and table shape.
            keys = [k for k in range(10) if (k + key) % 3 != 0]
            lists = [ids[j % (len(ids) + 1):] for j in range(len(keys))]
            twin = BlockTableRows(1, 1)
            twin.table, twin.width = table.table.clone(), list(table.width)
            twin._row, twin._free_rows = dict(table._row), list(table._free_rows)
            for k, more in zip(keys, lists):
                twin.set(k, more)
            table.set_many(keys, lists)
            assert table._row == twin._row and table.width == twin.width
            assert table.table.shape == twin.table.shape
            for k, more in zip(keys, lists):
                oracle[k] = list(more)
        elif op == "remove":
            table.remove(key)
            oracle.pop(key, None)
        elif op == "copy" and oracle:
            # Held rows into other keys (held or new), each as it was before the copy;
            # cut to its first half when ``ids`` is not empty.
            srcs = sorted(oracle)[:3]
            dsts = [k for k in range(10) if k not in srcs and (k + key) % 3 == 0][: len(srcs)]
            srcs = srcs[: len(dsts)]
            lengths = [len(oracle[k]) // 2 for k in srcs] if ids else None
            table.copy_rows(srcs, dsts, lengths)
            for i, (src, dst) in enumerate(zip(srcs, dsts)):
                oracle[dst] = oracle[src][: lengths[i]] if lengths else list(oracle[src])
        assert {k: table.get(k) for k in oracle} == oracle
        assert all((k in table) == (k in oracle) for k in range(10))
    if oracle:  # one gather returns every row's leading ids, in the order asked
        keys = sorted(oracle)
        cols = max(len(v) for v in oracle.values())
        got = table.gather(torch.tensor([table.row(k) for k in keys]), cols)
        assert got.shape == (len(keys), max(1, cols))
        for i, k in enumerate(keys):
            assert got[i, : len(oracle[k])].tolist() == oracle[k]
    # Rows are reused, never shared: live keys sit in distinct rows.
    live_rows = [table.row(k) for k in oracle]
    assert len(set(live_rows)) == len(live_rows)
