"""Token embeddings and the LM head, split across tensor-parallel ranks by vocabulary rows.

Rank ``r`` keeps rows ``[r * per_rank, (r + 1) * per_rank)`` of the ``[vocab, dim]``
table, ``per_rank = ceil(vocab / tp_size)``; rows past the vocabulary (the last rank's
padding when ``tp_size`` does not divide it) are zero and never looked up, and their
logits are cut off. With ``tp_size=1`` the table is exactly ``[vocab, dim]`` and the
layers compute ``F.embedding`` / ``F.linear`` and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.layers import lm_head_screen
from tandem.core.layers.parallel_state import resolve_tp_group
from tandem.core.weight_loading import WeightLoaderModule, check_shape


class VocabParallelEmbedding(WeightLoaderModule):
    """``[num_tokens] ids -> [num_tokens, embedding_dim]``; each rank looks up the ids in its
    rows and the ranks' results are summed (``reduce_results=False``: this rank's part).

    :meth:`logits` uses the same table as a tied LM head.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        reduce_results: bool = True,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.tp = resolve_tp_group(tp_size, tp_rank)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_results = reduce_results
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp.size)
        self.vocab_start_index = min(self.tp.rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.bind_weight_loaders()
        self.logits_kernel = None  # a packed copy of the table for the LM-head GEMM (linear_kernels)
        self.screen_head = None  # its int8 copy for greedy steps (lm_head_screen; kernel_setup sets it)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"shard_id={shard_id!r} given to {type(self).__name__}, which is not packed")
        check_shape(loaded_weight, (self.num_embeddings, *param.shape[1:]))
        rows = self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start_index, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * mine  # other ranks' ids look up row 0 ...
        out = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # ... and are zeroed
        return self.tp.all_reduce(out) if self.reduce_results else out

    def logits(
        self, hidden_states: torch.Tensor, gather_output: bool = True, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[num_seqs, embedding_dim] -> [num_seqs, num_embeddings]`` (this rank's
        ``[num_seqs, num_embeddings_per_partition]`` with ``gather_output=False``).

        ``bias`` (``[num_embeddings]`` or ``[1, num_embeddings]``, e.g. BART's
        ``final_logits_bias``) is added inside the GEMM: a separate add over the
        full-vocabulary logits costs a fresh ``[num_seqs, vocab]`` tensor per step."""
        own = getattr(self, "bias", None)
        if bias is not None:
            bias = bias.reshape(-1)
            if self.tp.size > 1:  # this rank's columns, padded like its table
                bias = F.pad(bias[self.vocab_start_index : self.vocab_end_index],
                             (0, self.num_embeddings_per_partition - (self.vocab_end_index - self.vocab_start_index)))
            bias = bias if own is None else own + bias
        else:
            bias = own
        # A compiled graph keeps the plain head (it is traced once, for every step after).
        screen = (lm_head_screen.active() if self.screen_head is not None and self.tp.size == 1
                  and not torch.compiler.is_compiling() else None)
        if screen is not None and (approx := screen.offer(self, self.screen_head, hidden_states, bias)) is not None:
            return approx  # int8 logits the step's greedy rows resolve exactly (layers/lm_head_screen.py)
        logits = self.head_logits(hidden_states, bias)
        if not gather_output or self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., : self.num_embeddings]

    def head_logits(self, hidden_states: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The LM-head GEMM with ``bias`` as given (already this rank's, own bias included)."""
        if self.logits_kernel is not None:
            return self.logits_kernel(self, hidden_states, bias, None)
        return F.linear(hidden_states, self.weight, bias)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp_size={self.tp.size}, tp_rank={self.tp.rank}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: ``forward(hidden_states)`` returns full-vocabulary logits.

    A model with tied embeddings keeps no head of its own: it calls
    ``embed_tokens.logits(hidden_states)`` on its :class:`VocabParallelEmbedding`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size=tp_size, tp_rank=tp_rank)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.bind_weight_loaders()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden_states)
