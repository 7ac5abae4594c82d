"""What the worker keeps from one step to the next (issue 49): the runner's rows of the
last step (``model_runner._Rows``: table rows, cross rows, cross lengths and tables,
reused while a step lists the same sequences and no row was added or dropped), and
the tables of the groups the scheduler leaves out of ``SchedulerOutput.table_updates``
(its steady decode records, whose tables the worker is not asked to look at), and the
cpu_paged builder's cross metadata, kept while the runner hands on the same rows.

The oracle is a build from nothing at every step of test_randomized_steps' mixed runs
(preemption by recompute and swap, aborts, speculation, structured output, LoRA,
beams, n > 1): after each ``prepare`` the kept rows equal rows built now, and every
scheduled sequence's table row and its request's cross row hold exactly the block
manager's tables; after each cpu_paged build, its cross metadata equals one built with
nothing kept. The tokens of those runs are checked there against solo runs.
"""

from __future__ import annotations

import pytest
import torch

import test_randomized_steps as trs
from test_randomized_steps import checkpoint, one_thread  # noqa: F401 - fixtures

from tandem.core.worker.model_runner import ModelRunner


def _checked(engine, counts: dict[str, int]):
    runner, bm, sched = engine.executor.worker.runner, engine.block_manager, engine.scheduler
    prepare = runner.prepare

    def checked_prepare(out):
        before = runner._last
        inputs = prepare(out)
        kept = runner._last
        counts["steps"] += 1
        counts["reused"] += kept is before
        counts["left_out"] += len(out.scheduled) - (len(out.table_updates) if out.table_updates is not None
                                                    else len(out.scheduled))
        runner._last = None
        try:
            fresh = ModelRunner._rows(runner, out, list(kept.seq_ids))
        finally:
            runner._last = kept
        assert torch.equal(fresh.rows, kept.rows)
        assert fresh.cross_lens == kept.cross_lens
        assert torch.equal(fresh.cross_tables, kept.cross_tables)
        for sg in out.scheduled:
            group = sched.groups[sg.request_id]
            assert runner.cross_tables.get(sg.request_id) == list(bm.get_cross_block_table(group)), sg.request_id
            by_id = {s.seq_id: s for s in group.seqs}
            for ss in sg.seqs:
                assert runner.tables.get(ss.seq_id) == list(bm.get_block_table(by_id[ss.seq_id])), ss.seq_id
        return inputs

    runner.prepare = checked_prepare
    builder = runner.builder
    if hasattr(builder, "_cross_memo"):  # cpu_paged: its cross metadata kept while the rows are
        build = builder.build

        def checked_build(inputs):
            before = builder._cross_memo
            md = build(inputs)
            counts["memo"] += before is not None and builder._cross_memo is before
            builder._cross_memo = None
            try:
                fresh = build(inputs)
            finally:
                builder._cross_memo = before if builder._cross_memo is None else builder._cross_memo
            assert torch.equal(md.cross_seq_lens_t, fresh.cross_seq_lens_t)
            assert (md.cross_groups is None) == (fresh.cross_groups is None)
            if md.cross_groups is not None:
                assert torch.equal(md.cross_groups, fresh.cross_groups)
            assert torch.equal(md.cross_decode_seqs, fresh.cross_decode_seqs)
            assert torch.equal(md.cross_decode_rows, fresh.cross_decode_rows)
            return md

        builder.build = checked_build
    return engine


@pytest.mark.parametrize("seed", trs.DEFAULT_SEEDS)
def test_kept_rows_and_unsent_tables_equal_a_build_from_nothing(checkpoint, seed, monkeypatch):  # noqa: F811
    counts = {"steps": 0, "reused": 0, "left_out": 0, "memo": 0}
    build = trs.build_engine
    monkeypatch.setattr(trs, "build_engine", lambda *a, **k: _checked(build(*a, **k), counts))
    case, _ = trs.run_case(seed, checkpoint)
    # Both paths ran: rows kept from the last step and rows built; groups left out where
    # the engine does not speculate (a speculating request's strategy drafts: no steady record).
    assert counts["reused"] > 0 and counts["reused"] < counts["steps"], counts
    assert counts["left_out"] > 0 or case.speculative, counts
    assert counts["memo"] > 0, counts
