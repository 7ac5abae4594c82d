"""Turns scheduled groups into the tensors one forward pass needs.

Token-level tensors (positions, slot mappings) are built with index
arithmetic on whole tensors; Python only loops over sequences.
"""

from __future__ import annotations

import torch

from tandem.core.attention import AttentionMetadataBuilder, StepInputs
from tandem.core.model import EncoderDecoderModel
from tandem.core.sequence import Sequence, SequenceGroupMetadata


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def _packed_positions(starts: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For runs of ``lens`` tokens beginning at position ``starts``: (run index, position)."""
    run = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    begin = torch.cumsum(lens, 0) - lens
    offsets = torch.arange(int(lens.sum())) - begin[run]
    return run, starts[run] + offsets


def _slots(tables: torch.Tensor, run: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    return tables[run, pos // block_size] * block_size + pos % block_size


class ModelRunner:
    def __init__(
        self,
        model: EncoderDecoderModel,
        builder: AttentionMetadataBuilder,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.builder = builder
        self.block_size = block_size
        self.device = device

    def prepare(self, groups: list[SequenceGroupMetadata]) -> tuple[StepInputs, list[Sequence]]:
        bs = self.block_size
        seqs: list[Sequence] = []
        tokens: list[int] = []
        tables: list[list[int]] = []
        cross_tables: list[list[int]] = []
        cross_lens: list[int] = []
        enc_tokens: list[int] = []
        enc_lens: list[int] = []
        enc_tables: list[list[int]] = []
        for meta in groups:
            enc_len = len(meta.encoder_token_ids)
            if meta.run_encoder:
                enc_tokens.extend(meta.encoder_token_ids)
                enc_lens.append(enc_len)
                enc_tables.append(meta.cross_block_table)
            for seq in meta.seqs:
                seqs.append(seq)
                tokens.extend(seq.token_ids[seq.num_computed_tokens :])
                tables.append(meta.block_tables[seq.seq_id])
                cross_tables.append(meta.cross_block_table)
                cross_lens.append(enc_len)

        computed = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.long)
        query_lens = [len(s) - s.num_computed_tokens for s in seqs]
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        block_tables = _pad_tables(tables)
        run, positions = _packed_positions(computed, q_lens)
        slot_mapping = _slots(block_tables, run, positions, bs)
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])

        e_lens = torch.tensor(enc_lens, dtype=torch.long)
        e_run, enc_positions = _packed_positions(torch.zeros_like(e_lens), e_lens)
        cross_slots = _slots(_pad_tables(enc_tables), e_run, enc_positions, bs) if enc_lens else e_run

        dev = self.device
        inputs = StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            slot_mapping=slot_mapping.to(dev, non_blocking=True),
            query_lens=query_lens,
            seq_lens=[len(s) for s in seqs],
            query_start_loc=query_start_loc.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            encoder_input_ids=torch.tensor(enc_tokens, dtype=torch.long).to(dev, non_blocking=True),
            encoder_positions=enc_positions.to(dev, non_blocking=True),
            encoder_seq_lens=enc_lens,
            cross_slot_mapping=cross_slots.to(dev, non_blocking=True),
            cross_seq_lens=cross_lens,
            cross_block_tables=_pad_tables(cross_tables).to(dev, non_blocking=True),
            logits_indices=(query_start_loc[1:] - 1).to(dev, non_blocking=True),
        )
        return inputs, seqs

    def execute(
        self, groups: list[SequenceGroupMetadata], kv_caches: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the model; returns float32 logits ``[S, vocab]`` for each sequence's last token."""
        inputs, seqs = self.prepare(groups)
        attn_metadata = self.builder.build(inputs)
        hidden = self.model(
            inputs.input_ids,
            inputs.positions,
            inputs.encoder_input_ids,
            inputs.encoder_positions,
            kv_caches,
            attn_metadata,
        )
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return logits.float(), seqs
