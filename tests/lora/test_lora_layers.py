"""The batched low-rank update of one linear layer (``tandem.lora.layers``), every layer
kind, one and several tensor-parallel ranks, against an independent oracle: the same
layer with the adapter merged into its weight (``W + scaling * B @ A``, loaded through
the layer's own weight loader), row by row for the row's adapter, in float64."""

from __future__ import annotations

import pytest
import torch

from tandem.core.layers import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.lora.layers import DECODER, ENCODER, LinearLoRA, LoRAStep
from tandem.lora.mapping import _this_rank, shards_of

f64 = torch.float64
MAX_RANK, SLOTS = 4, 3


def rand(*shape):
    return torch.randn(*shape, dtype=f64)


# (builder(tp, rank), [(shard id, full out rows)], full in features)
KINDS = {
    "column": (lambda tp, r: ColumnParallelLinear(8, 12, tp_size=tp, tp_rank=r), [(None, 12)], 8),
    "merged": (lambda tp, r: MergedColumnParallelLinear(8, [6, 10], tp_size=tp, tp_rank=r), [(0, 6), (1, 10)], 8),
    "qkv": (lambda tp, r: QKVParallelLinear(8, 2, 4, 2, tp_size=tp, tp_rank=r), [("q", 8), ("k", 4), ("v", 4)], 8),
    "row": (lambda tp, r: RowParallelLinear(12, 8, reduce_results=False, tp_size=tp, tp_rank=r), [(None, 8)], 12),
}


def _load(layer, weights):
    layer = layer.to(f64)
    for shard, w in weights:
        if shard is None:
            layer.weight.weight_loader(layer.weight, w)
        else:
            layer.weight.weight_loader(layer.weight, w, shard)
    layer.bias.data.normal_()
    return layer


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("tp", [1, 2])
def test_each_rows_update_is_its_adapters_merged_weight(kind, tp):
    torch.manual_seed(0)
    build, shards, n_in = KINDS[kind]
    base = [(s, rand(n, n_in)) for s, n in shards]
    # Two adapters, ranks 4 and 2 (zero-padded in the slot); the second skips the last shard.
    adapters = {
        0: [(rand(4, n_in), rand(n, 4), 0.5) for _, n in shards],
        2: [(rand(2, n_in), rand(n, 2), 2.0) if k < len(shards) - 1 or len(shards) == 1 else None
            for k, (_, n) in enumerate(shards)],
    }
    slots = torch.tensor([-1, 0, 2, 0, -1, 2])
    x = rand(len(slots), n_in)
    for rank in range(tp):
        layer = _load(build(tp, rank), base)
        step = LoRAStep(MAX_RANK, f64, torch.device("cpu"))
        layer.lora = LinearLoRA(step, DECODER, shards_of(layer), layer.input_size, SLOTS, f64, torch.device("cpu"))
        for slot, parts in adapters.items():
            for k, part in enumerate(parts):
                if part is not None:
                    a, b, scaling = part
                    a_local, b_local = _this_rank(layer, a, b * scaling, shards[k][0])
                    layer.lora.set_slot(slot, k, a_local, b_local)
        bias = layer.bias.detach().clone()
        with step.active(slots, torch.empty(0, dtype=torch.long)):
            got = layer(x) if kind != "row" else _partial(layer, x)
        for i, slot in enumerate(slots.tolist()):
            merged = [(s, w + (0 if slot < 0 or adapters[slot][k] is None
                               else adapters[slot][k][2] * adapters[slot][k][1] @ adapters[slot][k][0]))
                      for k, (s, w) in enumerate(base)]
            ref = _load(build(tp, rank), merged)
            ref.bias.data.copy_(bias)
            want = ref(x[i: i + 1]) if kind != "row" else _partial(ref, x[i: i + 1])
            torch.testing.assert_close(got[i: i + 1], want, rtol=1e-12, atol=1e-12)


def _partial(layer, x):
    """A row-parallel rank's partial sum, given its slice of the input."""
    cols = layer.input_size
    return layer(x[:, layer.tp_rank * cols: (layer.tp_rank + 1) * cols])


def test_encoder_side_layers_read_the_encoder_tokens_slots():
    torch.manual_seed(1)
    layer = _load(ColumnParallelLinear(8, 6), [(None, rand(6, 8))])
    step = LoRAStep(MAX_RANK, f64, torch.device("cpu"))
    layer.lora = LinearLoRA(step, ENCODER, shards_of(layer), 8, SLOTS, f64, torch.device("cpu"))
    a, b = rand(4, 8), rand(6, 4)
    layer.lora.set_slot(1, 0, a, b)
    x = rand(3, 8)
    base = layer(x)  # outside a step: the base weights
    with step.active(torch.tensor([1, 1]), torch.tensor([-1, 1, -1])):
        got = layer(x)
    torch.testing.assert_close(got[[0, 2]], base[[0, 2]], rtol=0, atol=0)
    torch.testing.assert_close(got[1], base[1] + b @ a @ x[1], rtol=1e-12, atol=1e-12)


def test_a_step_context_does_not_nest():
    step = LoRAStep(MAX_RANK, f64, torch.device("cpu"))
    none = torch.empty(0, dtype=torch.long)
    with step.active(none, none), pytest.raises(RuntimeError, match="does not nest"):
        with step.active(none, none):
            pass
