"""Turns a ``SchedulerOutput`` into the tensors one forward pass needs, and runs it.

Block tables persist across steps (``BlockTableRows``): the scheduler sends
only what changed, and names the groups whose tables may have changed
(``SchedulerOutput.table_updates``), so a steady decode step looks at none.
Token-level tensors (positions, slot mappings) are built with index arithmetic
on whole tensors; Python only loops over sequences. What depends only on which
sequences run, in which order (their table rows, cross tables and lengths), is
kept from the last step and reused while the step lists the same sequences and
no table row was added, dropped or given a new cross table since (``_Rows``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from tandem.core.attention import AttentionMetadataBuilder, StepInputs
from tandem.core.layers import lm_head_screen
from tandem.core.model import EncoderDecoderModel
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.cross_compress import CrossKVCompressor
from tandem.core.worker.compiled_step import CompiledDecodeStep
from tandem.core.worker.input_batch import BlockTableRows


def _packed_positions(starts: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For runs of ``lens`` tokens beginning at position ``starts``: (run index, position)."""
    run = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    begin = torch.cumsum(lens, 0) - lens
    offsets = torch.arange(int(lens.sum())) - begin[run]
    return run, starts[run] + offsets


def _slots(tables: torch.Tensor, run: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    return tables[run, pos // block_size] * block_size + pos % block_size


@dataclass
class _Rows:
    """What a step's rows need that depends only on which sequences run, in which
    order: kept for the next step, which reuses it while it lists the same sequences
    and ``ModelRunner._layout`` has not changed (a table row added or dropped, a
    cross table set)."""

    seq_ids: list[int]
    layout: int  # ModelRunner._layout when built
    rows: torch.Tensor  # [S] each sequence's row of ``tables``
    cross_lens: list[int]  # [S]
    cross_tables: torch.Tensor  # [S, max cross blocks]


class ModelRunner:
    def __init__(
        self,
        model: EncoderDecoderModel,
        builder: AttentionMetadataBuilder,
        block_size: int,
        device: torch.device,
        max_num_seqs: int = 8,
        max_blocks_per_seq: int = 8,
        cross_compress: CrossKVCompressor | None = None,
        compiled: CompiledDecodeStep | None = None,
    ) -> None:
        self.model = model
        self.cross_compress = cross_compress  # kv_compress: observes cross attention in the window
        self.compiled = compiled  # decode steps through compiled graphs; None: every step eager
        self.builder = builder
        self.block_size = block_size
        self.device = device
        self.tables = BlockTableRows(max_num_seqs, max_blocks_per_seq)  # by seq id
        self.cross_tables = BlockTableRows(max_num_seqs, max_blocks_per_seq)  # by request id
        self._cross_lists: dict[str, list[int]] = {}
        self.lora = None  # the worker's tandem.lora.manager.LoRAManager when enable_lora
        # Bumped whenever a table row is added or dropped or a cross table is set: what
        # _Rows keeps is then built again.
        self._layout = 0
        self._last: _Rows | None = None  # the last step's (None until a step has run)
        self._inputs: StepInputs | None = None  # the last step's inputs (execute_next advances them)

    # -- persistent state ------------------------------------------------------
    def forget_seqs(self, seq_ids: list[int]) -> None:
        if seq_ids:
            self._layout += 1
        for seq_id in seq_ids:
            self.tables.remove(seq_id)

    def copy_seqs(self, copies: list[tuple[int, int, int, list[int]]]) -> None:
        """``SchedulerOutput.seq_copies``: each dst's table becomes the first ``n`` ids of
        its src's, then the ids given (a row copy and one write for all)."""
        src, dst, kept, tails = zip(*copies)
        self._layout += 1
        self.tables.copy_rows(src, dst, kept)
        self.tables.extend_many(dst, tails)

    def forget_request(self, request_id: str) -> None:
        self._layout += 1
        self.cross_tables.remove(request_id)
        self._cross_lists.pop(request_id, None)

    def _updated_groups(self, out: SchedulerOutput) -> list:
        """The groups whose tables may have changed (``SchedulerOutput.table_updates``)."""
        if out.table_updates is None:
            return out.scheduled
        scheduled = out.scheduled
        return [scheduled[i] for i in out.table_updates]

    def _update_tables(self, groups: list) -> None:
        """The groups' table updates: rows set and appended to, in one write per kind
        (``set_many``, ``extend_many``), not a tensor a row (a first step sets two rows a
        request; a step where every row opens a block appends to all)."""
        known, cross_lists = self.tables.keys(), self._cross_lists
        cross_keys, cross_ids, set_keys, set_ids, ext_keys, ext_ids = [], [], [], [], [], []
        try:
            for group in groups:
                if cross_lists.get(group.request_id) != group.cross_block_table:
                    cross_lists[group.request_id] = group.cross_block_table
                    cross_keys.append(group.request_id)
                    cross_ids.append(group.cross_block_table)
                    self._layout += 1
                for seq in group.seqs:
                    if seq.replace_blocks:
                        if seq.seq_id not in known:
                            self._layout += 1  # a new row
                        set_keys.append(seq.seq_id)
                        set_ids.append(seq.block_ids)
                    elif seq.seq_id not in known:
                        raise RuntimeError(f"sequence {seq.seq_id}: block-table update for an unknown table")
                    elif seq.block_ids:  # usually none: a decode step fills a block it holds
                        ext_keys.append(seq.seq_id)
                        ext_ids.append(seq.block_ids)
        finally:  # what came before a bad update is applied, as it was one by one
            if cross_keys:
                self.cross_tables.set_many(cross_keys, cross_ids)
            if set_keys:
                self.tables.set_many(set_keys, set_ids)
            if ext_keys:
                self.tables.extend_many(ext_keys, ext_ids)

    # -- the step --------------------------------------------------------------
    def _rows(self, out: SchedulerOutput, seq_ids: list[int]) -> _Rows:
        """The step's ``_Rows``: last step's when it lists the same sequences and the
        layout is unchanged, else built now (kv_compress: always, its cross lengths
        and tables change under a group)."""
        last = self._last
        if (last is not None and last.layout == self._layout and last.seq_ids == seq_ids
                and self.cross_compress is None):
            return last
        scheduled = out.scheduled
        rows = torch.tensor(self.tables.rows(seq_ids), dtype=torch.long)
        cross_rows = torch.tensor(self.cross_tables.rows([g.request_id for g in scheduled for _ in g.seqs]),
                                  dtype=torch.long)
        cross_lens = [g.num_encoder_positions for g in scheduled for _ in g.seqs]
        cross_tables = self.cross_tables.gather(cross_rows, -(-max(cross_lens) // self.block_size))
        self._last = _Rows(seq_ids, self._layout, rows, cross_lens, cross_tables)
        return self._last

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        updated = self._updated_groups(out)
        self._update_tables(updated)
        bs = self.block_size
        seqs = [s for g in out.scheduled for s in g.seqs]
        seq_ids = [s.seq_id for s in seqs]
        step_rows = self._rows(out, seq_ids)
        query_lens = [len(s.token_ids) for s in seqs]
        computed_list = [s.num_computed_tokens for s in seqs]
        seq_lens = [c + q for c, q in zip(computed_list, query_lens)]
        cross_lens, cross_tables = step_rows.cross_lens, step_rows.cross_tables
        max_query_len, max_seq_len, max_cross_len = max(query_lens), max(seq_lens), max(cross_lens)
        block_tables = self.tables.gather(step_rows.rows, -(-max_seq_len // bs))

        computed = torch.tensor(computed_list, dtype=torch.long)
        if max_query_len == 1:  # decodes only: one token at each sequence's end
            run, positions = torch.arange(len(seqs)), computed
            query_start_loc = torch.arange(len(seqs) + 1)
        else:
            q_lens = torch.tensor(query_lens, dtype=torch.long)
            run, positions = _packed_positions(computed, q_lens)
            query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.long)
            torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        slot_mapping = _slots(block_tables, run, positions, bs)

        encoders = [g for g in updated if g.encoder_inputs is not None]  # the scheduled order
        enc_lens = [g.encoder_inputs.num_positions for g in encoders]
        features = [g.encoder_inputs.features for g in encoders if g.encoder_inputs.token_ids is None]
        if features and len(features) != len(encoders):
            raise RuntimeError("one step mixes token and feature encoder inputs; a model makes one kind")
        if features:  # the model's encoder input: the groups' features, stacked (a list if shapes differ)
            if len({tuple(f.shape) for f in features}) == 1:
                encoder_input = torch.stack([f.to(torch.float32) for f in features])
            else:
                encoder_input = [f.to(torch.float32) for f in features]
        else:
            enc_tokens = list(itertools.chain.from_iterable(g.encoder_inputs.token_ids for g in encoders))
            encoder_input = torch.tensor(enc_tokens, dtype=torch.long)
        max_enc_len = max(enc_lens, default=0)
        if encoders:
            e_lens = torch.tensor(enc_lens, dtype=torch.long)
            e_run, enc_positions = _packed_positions(torch.zeros_like(e_lens), e_lens)
            enc_rows = torch.tensor([self.cross_tables.row(g.request_id) for g in encoders], dtype=torch.long)
            enc_tables = self.cross_tables.gather(enc_rows, -(-max_enc_len // bs))
            cross_slots = _slots(enc_tables, e_run, enc_positions, bs)
        else:  # a decode step: no encoder positions, no cross slots (five tensor ops saved)
            enc_positions = cross_slots = torch.empty(0, dtype=torch.long)

        dev = self.device
        observer = None
        if self.cross_compress is not None and any(g.cross_observe_until for g in out.scheduled):
            starts, seq_rows, i = query_start_loc.tolist(), [], 0
            for g in out.scheduled:
                seq_rows.append([(starts[i + j], s.num_computed_tokens) for j, s in enumerate(g.seqs)])
                i += len(g.seqs)
            observer = self.cross_compress.observer(out.scheduled, seq_rows, dev)
        per_head, offsets, lens = self._per_head_layouts(out, dev)
        tokens = [t for s in seqs for t in s.token_ids]
        return StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            slot_mapping=slot_mapping.to(dev, non_blocking=True),
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            encoder_input_ids=(
                [f.to(dev, non_blocking=True) for f in encoder_input]
                if isinstance(encoder_input, list)
                else encoder_input.to(dev, non_blocking=True)
            ),
            encoder_positions=enc_positions.to(dev, non_blocking=True),
            encoder_seq_lens=enc_lens,
            cross_slot_mapping=cross_slots.to(dev, non_blocking=True),
            cross_seq_lens=cross_lens,
            cross_block_tables=cross_tables.to(dev, non_blocking=True),
            logits_indices=self._logits_indices(seqs, query_start_loc).to(dev, non_blocking=True),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            max_encoder_seq_len=max_enc_len,
            max_cross_seq_len=max_cross_len,
            cross_observer=observer,
            cross_per_head_seqs=per_head,
            cross_head_offsets=offsets,
            cross_head_lens=lens,
        )

    def _per_head_layouts(self, out: SchedulerOutput, dev: torch.device):
        """kv_compress per head: the sequences whose cross table is re-packed per head, and
        their (layer, head) offsets and lengths (``AttentionMetadata.cross_head_offsets``)."""
        cc = self.cross_compress
        if cc is None or not cc.layouts:
            return [], None, None
        seqs, offsets, lens, i = [], [], [], 0
        for g in out.scheduled:
            layout = cc.layouts.get(g.request_id) if g.cross_compressed else None
            for _ in g.seqs:
                if layout is not None:
                    seqs.append(i)
                    offsets.append(layout[0])
                    lens.append(layout[1])
                i += 1
        if not seqs:
            return [], None, None
        return seqs, torch.stack(offsets).to(dev), torch.stack(lens).to(dev)

    @staticmethod
    def _logits_indices(seqs, query_start_loc: torch.Tensor) -> torch.Tensor:
        """Token indices whose logits are returned: each sequence's last ``num_logits``."""
        ends = query_start_loc[1:]
        counts = [s.num_logits for s in seqs]
        if max(counts) == 1:  # num_logits >= 1
            return ends - 1
        n = torch.tensor(counts, dtype=torch.long)
        run, offsets = _packed_positions(torch.zeros_like(n), n)
        return ends[run] - n[run] + offsets

    @staticmethod
    def lora_token_slots(out: SchedulerOutput, slot_of: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each decoder token's and each encoder position's adapter slot (-1: none), in
        the order ``prepare`` packs them: a group's slot repeated over its tokens."""
        groups = out.scheduled
        dec_slots = torch.tensor([slot_of.get(g.request_id, -1) for g in groups for _ in g.seqs], dtype=torch.long)
        dec_lens = torch.tensor([len(s.token_ids) for g in groups for s in g.seqs], dtype=torch.long)
        encoders = [g for g in groups if g.encoder_inputs is not None]
        enc_slots = torch.tensor([slot_of.get(g.request_id, -1) for g in encoders], dtype=torch.long)
        enc_lens = torch.tensor([g.encoder_inputs.num_positions for g in encoders], dtype=torch.long)
        return dec_slots.repeat_interleave(dec_lens), enc_slots.repeat_interleave(enc_lens)

    @staticmethod
    def _is_decode_step(inputs: StepInputs) -> bool:
        """One new token and one row of logits per sequence, and no encoder."""
        return (
            inputs.max_query_len == 1
            and inputs.logits_indices.shape[0] == inputs.input_ids.shape[0]
            and inputs.encoder_positions.shape[0] == 0
            and not isinstance(inputs.encoder_input_ids, list)
        )

    def execute(self, out: SchedulerOutput, kv_caches: list[torch.Tensor],
                lora_slots: dict[str, int] | None = None) -> torch.Tensor:
        """Run the model; returns float32 logits ``[R, vocab]``: each scheduled sequence's
        last ``num_logits`` positions (usually its last token), in the order ``out``
        lists them. ``lora_slots``: the adapter slot of each request that has one."""
        inputs = self._inputs = self.prepare(out)
        return self._run(inputs, out, kv_caches, lora_slots)

    def execute_next(self, tokens: torch.Tensor, kv_caches: list[torch.Tensor], out: SchedulerOutput,
                     lora_slots: dict[str, int] | None = None) -> torch.Tensor:
        """The next step of a run of decode steps (``SchedulerOutput.num_steps``): the
        last step's rows, each one token on, ``tokens`` ``[S]`` their inputs. Their
        tables hold the run's blocks (the scheduler sent them with the run's first step)."""
        last, bs = self._inputs, self.block_size
        max_seq_len = last.max_seq_len + 1
        block_tables = last.block_tables
        if max_seq_len > block_tables.shape[1] * bs:  # a row's position opens a block of the run
            block_tables = self.tables.gather(self._last.rows, -(-max_seq_len // bs)).to(self.device, non_blocking=True)
        positions = last.positions + 1
        inputs = self._inputs = dataclasses.replace(
            last,
            input_ids=tokens.to(self.device, non_blocking=True),
            positions=positions,
            slot_mapping=_slots(block_tables, torch.arange(len(last.seq_lens), device=self.device), positions, bs),
            seq_lens=[n + 1 for n in last.seq_lens],
            block_tables=block_tables,
            max_seq_len=max_seq_len,
        )
        return self._run(inputs, out, kv_caches, lora_slots)

    def _run(self, inputs: StepInputs, out: SchedulerOutput, kv_caches: list[torch.Tensor],
             lora_slots: dict[str, int] | None) -> torch.Tensor:
        attn_metadata = self.builder.build(inputs)
        # A compiled graph runs a plain decode step: no adapters (the compiled step is not
        # built with enable_lora) and no kv_compress observation (it reads the attention weights).
        if self.compiled is not None and inputs.cross_observer is None and not inputs.cross_per_head_seqs \
                and self._is_decode_step(inputs):
            with lm_head_screen.screening(None):  # a compiled graph keeps the plain LM head
                logits = self.compiled(inputs.input_ids, inputs.positions, kv_caches, attn_metadata)
            if logits is not None:
                return logits
        if self.lora is None:
            hidden = self._forward(inputs, kv_caches, attn_metadata)
        else:
            with self.lora.step.active(*self.lora_token_slots(out, lora_slots or {})):
                hidden = self._forward(inputs, kv_caches, attn_metadata)
        if inputs.cross_observer is not None:
            inputs.cross_observer.commit()
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return logits.float()

    def _forward(self, inputs: StepInputs, kv_caches, attn_metadata) -> torch.Tensor:
        return self.model(
            inputs.input_ids,
            inputs.positions,
            inputs.encoder_input_ids,
            inputs.encoder_positions,
            kv_caches,
            attn_metadata,
        )
