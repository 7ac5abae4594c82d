"""Tensor-parallel layers and the generic weight loader.

Each layer is built as every rank of a group (``tp_size=2``, ``tp_rank=0/1``, and 3
where the arithmetic differs), loaded from one random full weight through its
parameters' ``weight_loader``, and checked against a float64 reference: the
column-parallel ranks' outputs concatenate, and the row-parallel ranks' partial
outputs sum, to the full linear. One test runs the collectives for real (gloo, two
processes) through BART's encoder and LM head.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_tp_group,
    tensor_parallel,
)
from tandem.core.weight_loading import WeightShapeError, load_checkpoint

f64 = torch.float64


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=f64)


def load(layer: nn.Module, **tensors) -> nn.Module:
    """``layer`` in float64 with ``tensors`` (param name -> full tensor, or a list of
    ``(shard_id, tensor)``) loaded through each parameter's ``weight_loader``."""
    layer = layer.to(f64)
    for name, value in tensors.items():
        param = getattr(layer, name)
        for shard_id, tensor in value if isinstance(value, list) else [(None, value)]:
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
    return layer


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- linear layers ----------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_column_parallel_outputs_concatenate_to_the_full_linear(tp, bias):
    w, b, x = rand(12, 5), rand(12) if bias else None, rand(7, 5)
    outs = []
    for rank in range(tp):
        tensors = dict(weight=w, **({"bias": b} if bias else {}))
        layer = load(ColumnParallelLinear(5, 12, bias=bias, tp_size=tp, tp_rank=rank), **tensors)
        rows = slice(rank * 12 // tp, (rank + 1) * 12 // tp)
        assert torch.equal(layer.weight, w[rows])
        if bias:
            assert torch.equal(layer.bias, b[rows])
        else:
            assert layer.bias is None
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b), rtol=0, atol=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_row_parallel_partial_outputs_sum_to_the_full_linear(tp):
    w, b, x = rand(5, 12), rand(5), rand(7, 12)
    partials = []
    for rank in range(tp):
        layer = load(RowParallelLinear(12, 5, reduce_results=False, tp_size=tp, tp_rank=rank), weight=w, bias=b)
        cols = slice(rank * 12 // tp, (rank + 1) * 12 // tp)
        assert torch.equal(layer.weight, w[:, cols]) and torch.equal(layer.bias, b)
        partials.append(layer(x[:, cols]))
    torch.testing.assert_close(sum(partials), F.linear(x, w, b), rtol=0, atol=1e-12)


def test_column_then_row_is_the_full_mlp_per_rank():
    """The FFN split: no communication between fc1 and fc2, one sum at the end."""
    w1, b1, w2, b2, x = rand(16, 6), rand(16), rand(6, 16), rand(6), rand(4, 6)
    ref = F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)
    partials = []
    for rank in range(2):
        fc1 = load(ColumnParallelLinear(6, 16, tp_size=2, tp_rank=rank), weight=w1, bias=b1)
        fc2 = load(RowParallelLinear(16, 6, reduce_results=False, tp_size=2, tp_rank=rank), weight=w2, bias=b2)
        partials.append(fc2(torch.relu(fc1(x))))
    torch.testing.assert_close(partials[0] + partials[1], ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_column_parallel_keeps_each_shards_slice(tp):
    sizes = [6, 10]
    ws, bs, x = [rand(n, 4) for n in sizes], [rand(n) for n in sizes], rand(3, 4)
    per_shard = [[], []]
    for rank in range(tp):
        layer = load(
            MergedColumnParallelLinear(4, sizes, tp_size=tp, tp_rank=rank),
            weight=list(enumerate(ws)),
            bias=list(enumerate(bs)),
        )
        assert layer.output_partition_sizes == [n // tp for n in sizes]
        expected = torch.cat([w[rank * (n // tp) : (rank + 1) * (n // tp)] for w, n in zip(ws, sizes)])
        assert torch.equal(layer.weight, expected)
        # The unsplit fused tensor loads the same way.
        whole = load(MergedColumnParallelLinear(4, sizes, tp_size=tp, tp_rank=rank), weight=torch.cat(ws))
        assert torch.equal(whole.weight, layer.weight)
        for i, part in enumerate(layer(x).split(layer.output_partition_sizes, dim=-1)):
            per_shard[i].append(part)
    for i in range(2):
        torch.testing.assert_close(torch.cat(per_shard[i], -1), F.linear(x, ws[i], bs[i]), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "tp, heads, kv_heads",
    [(1, 4, 4), (2, 4, 4), (2, 4, 2), (4, 8, 2), (2, 4, 1), (4, 4, 2)],  # MHA, GQA, MQA, KV replicated
)
def test_qkv_parallel_splits_heads_and_replicates_scarce_kv_heads(tp, heads, kv_heads):
    hidden, hs = 6, 3
    wq, wk, wv = rand(heads * hs, hidden), rand(kv_heads * hs, hidden), rand(kv_heads * hs, hidden)
    bq, bk, bv = rand(heads * hs), rand(kv_heads * hs), rand(kv_heads * hs)
    x = rand(5, hidden)
    ref_q, ref_k, ref_v = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)
    qs, ks = [], {}
    for rank in range(tp):
        layer = load(
            QKVParallelLinear(hidden, hs, heads, kv_heads, tp_size=tp, tp_rank=rank),
            weight=[("q", wq), ("k", wk), ("v", wv)],
            bias=[(0, bq), (1, bk), (2, bv)],  # indices work too
        )
        assert layer.num_heads == heads // tp and layer.num_kv_heads == max(1, kv_heads // tp)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        qs.append(q)
        # The rank's KV heads: its own slice, or (fewer KV heads than ranks) the one it shares.
        first_kv = rank * kv_heads // tp if kv_heads >= tp else rank // (tp // kv_heads)
        kv_cols = slice(first_kv * hs, first_kv * hs + layer.kv_size)
        torch.testing.assert_close(k, ref_k[:, kv_cols], rtol=0, atol=1e-12)
        torch.testing.assert_close(v, ref_v[:, kv_cols], rtol=0, atol=1e-12)
        ks.setdefault(first_kv, k)
        # Grouping holds per rank: q head h reads kv head h // (heads / kv_heads) of the full model.
        group = heads // kv_heads
        for h in range(layer.num_heads):
            global_h = rank * layer.num_heads + h
            assert global_h // group * hs in range(kv_cols.start, kv_cols.stop)
    torch.testing.assert_close(torch.cat(qs, -1), ref_q, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([ks[i] for i in sorted(ks)], -1), ref_k, rtol=0, atol=1e-12)


def test_qkv_with_one_rank_is_q_then_k_then_v():
    """The tp_size=1 layout equals the fused HF-order weight: what BART's numerics rely on."""
    wq, wk, wv = rand(8, 8), rand(8, 8), rand(8, 8)
    layer = load(QKVParallelLinear(8, 2, 4), weight=[("v", wv), ("q", wq), ("k", wk)])
    assert torch.equal(layer.weight, torch.cat([wq, wk, wv]))
    whole = load(QKVParallelLinear(8, 2, 4), weight=torch.cat([wq, wk, wv]))
    assert torch.equal(whole.weight, layer.weight)


# -- embeddings and the LM head -------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_vocab_parallel_embedding_and_logits(tp):
    vocab, dim = 11, 4  # 11 is divisible by none of 2, 3, 4: the last rank holds padding rows
    w, ids, hidden = rand(vocab, dim), torch.tensor([0, 10, 5, 6, 3, 10, 7]), rand(3, dim)
    bias = rand(1, vocab)  # BART's final_logits_bias shape, added inside the GEMM
    lookups, logits, biased = [], [], []
    for rank in range(tp):
        emb = load(VocabParallelEmbedding(vocab, dim, reduce_results=False, tp_size=tp, tp_rank=rank), weight=w)
        per = -(-vocab // tp)
        assert emb.weight.shape == (per, dim)
        expected = torch.zeros(per, dim, dtype=f64)
        mine = w[rank * per : (rank + 1) * per]
        expected[: len(mine)] = mine
        assert torch.equal(emb.weight, expected)
        lookups.append(emb(ids))
        logits.append(emb.logits(hidden, gather_output=False))
        biased.append(emb.logits(hidden, gather_output=False, bias=bias))
        assert biased[-1].shape == (3, per)
    assert torch.equal(sum(lookups), F.embedding(ids, w))  # one rank contributes each row, others zero
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], hidden @ w.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat(biased, -1)[:, :vocab], hidden @ w.T + bias, rtol=0, atol=1e-12)


def test_one_rank_embedding_is_plain_embedding_and_linear():
    w, ids, hidden = rand(7, 3), torch.tensor([[1, 6], [0, 2]]), rand(2, 3)
    emb = load(VocabParallelEmbedding(7, 3), weight=w)
    assert torch.equal(emb(ids), F.embedding(ids, w))
    assert torch.equal(emb.logits(hidden), F.linear(hidden, w))


@pytest.mark.parametrize("tp", [1, 2])
def test_parallel_lm_head_with_bias(tp):
    w, b, hidden = rand(9, 4), rand(9), rand(2, 4)
    parts = []
    for rank in range(tp):
        head = load(ParallelLMHead(9, 4, bias=True, tp_size=tp, tp_rank=rank), weight=w, bias=b)
        parts.append(head.logits(hidden, gather_output=False) if tp > 1 else head(hidden))
    torch.testing.assert_close(torch.cat(parts, -1)[:, :9], F.linear(hidden, w, b), rtol=0, atol=1e-12)


# -- errors and state ---------------------------------------------------------------


RANK0, RANK1 = dict(tp_size=2, tp_rank=0), dict(tp_size=2, tp_rank=1)


@pytest.mark.parametrize(
    "build, name, shape, shard_id, match",
    [
        (lambda: ColumnParallelLinear(4, 6, **RANK1), "weight", (3, 4), None, r"\(3, 4\), expected \(6, 4\)"),
        (lambda: RowParallelLinear(6, 4, **RANK0), "weight", (4, 3), None, r"\(4, 3\), expected \(4, 6\)"),
        (lambda: RowParallelLinear(6, 4, **RANK0), "bias", (2,), None, r"\(2,\), expected \(4,\)"),
        (lambda: QKVParallelLinear(8, 2, 4, 2, **RANK0), "weight", (8, 8), "k", r"\(8, 8\), expected \(4, 8\)"),
        (lambda: MergedColumnParallelLinear(4, [2, 6]), "weight", (2, 4), 1, r"\(2, 4\), expected \(6, 4\)"),
        (lambda: VocabParallelEmbedding(10, 4, **RANK1), "weight", (5, 4), None, r"\(5, 4\), expected \(10, 4\)"),
    ],
)
def test_weight_loaders_check_the_full_checkpoint_shape(build, name, shape, shard_id, match):
    param, tensor = getattr(build(), name), rand(*shape)
    with pytest.raises(WeightShapeError, match=match):
        param.weight_loader(param, tensor) if shard_id is None else param.weight_loader(param, tensor, shard_id)


def test_bad_shard_ids_are_refused():
    qkv, merged = QKVParallelLinear(8, 2, 4), MergedColumnParallelLinear(4, [2, 2])
    col = ColumnParallelLinear(4, 4)
    with pytest.raises(ValueError, match=r"shard_id='x' is not one of 'q', 'k', 'v'"):
        qkv.weight.weight_loader(qkv.weight, rand(8, 8), "x")
    with pytest.raises(ValueError, match=r"shard_id=2 is not one of 0..1"):
        merged.weight.weight_loader(merged.weight, rand(2, 4), 2)
    with pytest.raises(ValueError, match=r"shard_id=0 given to ColumnParallelLinear, which is not packed"):
        col.weight.weight_loader(col.weight, rand(4, 4), 0)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: ColumnParallelLinear(4, 5, **RANK0), r"output_size=5 is not divisible by tp_size=2"),
        (lambda: RowParallelLinear(5, 4, **RANK0), r"input_size=5 is not divisible by tp_size=2"),
        (lambda: QKVParallelLinear(8, 2, 3, **RANK0), r"total_num_heads=3 is not divisible by tp_size=2"),
        (lambda: QKVParallelLinear(8, 2, 4, 3), r"total_num_heads=4 is not a multiple of total_num_kv_heads=3"),
        (lambda: QKVParallelLinear(8, 2, 6, 2, tp_size=4, tp_rank=0), r"total_num_heads=6 is not divisible by"),
        (lambda: ColumnParallelLinear(4, 4, tp_size=2, tp_rank=2), r"tp_rank=2 must be .* in \[0, tp_size=2\)"),
        (lambda: ColumnParallelLinear(4, 4, tp_size=0, tp_rank=0), r"tp_size=0 must be a positive integer"),
    ],
)
def test_sizes_that_do_not_split_are_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_weight_loaders_survive_meta_to_empty():
    """The engine builds on meta, casts, then ``to_empty``: new Parameter objects each time."""
    with torch.device("meta"):
        mlp = nn.Sequential(ColumnParallelLinear(4, 8), RowParallelLinear(8, 4), VocabParallelEmbedding(5, 4))
    mlp = mlp.to(dtype=torch.bfloat16).to_empty(device="cpu")
    for name, param in mlp.named_parameters():
        assert param.device.type == "cpu" and param.dtype == torch.bfloat16, name
        assert param.weight_loader.__self__ is mlp.get_submodule(name.rpartition(".")[0]), name


def test_tensor_parallel_block_sets_the_default_group_and_does_not_nest():
    assert (get_tp_group().size, get_tp_group().rank) == (1, 0)
    with tensor_parallel(2, 1):
        layer = ColumnParallelLinear(4, 8)
        assert (layer.tp_size, layer.tp_rank) == (2, 1) and layer.weight.shape == (4, 4)
        assert RowParallelLinear(8, 4, tp_size=1, tp_rank=0).weight.shape == (4, 8)  # arguments win
        with pytest.raises(RuntimeError, match="do not nest"):
            with tensor_parallel(2, 0):
                pass
    assert get_tp_group().size == 1
    row = RowParallelLinear(8, 4, tp_size=2, tp_rank=0)
    with pytest.raises(RuntimeError, match=r"tp_size=2 needs torch.distributed initialised"):
        row(torch.zeros(1, 4))


# -- the generic loader ---------------------------------------------------------------


class _Attn(nn.Module):
    def __init__(self, cross: bool) -> None:
        super().__init__()
        if cross:
            self.q_proj = ColumnParallelLinear(4, 4)
            self.kv_proj = MergedColumnParallelLinear(4, [4, 4])
        else:
            self.qkv_proj = QKVParallelLinear(4, 2, 2)
        self.out_proj = RowParallelLinear(4, 4)


class _Tiny(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "kv_proj": ["k_proj", "v_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.encoder_attn = _Attn(False), _Attn(True)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("table", torch.zeros(3))

    def hf_to_tandem_name(self, name: str) -> str | None:
        return None if name.startswith("ignored.") else name.removeprefix("model.")


def _hf_state() -> dict[str, torch.Tensor]:
    state = {}
    for attn in ("self_attn", "encoder_attn"):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            state[f"model.{attn}.{proj}.weight"], state[f"model.{attn}.{proj}.bias"] = rand(4, 4), rand(4)
    state.update({"model.norm.weight": rand(4), "model.norm.bias": rand(4), "ignored.head": rand(2)})
    return state


def test_generic_loader_routes_packed_shards_by_the_sibling_that_exists():
    model, state = _Tiny().to(f64), _hf_state()
    filled = load_checkpoint(model, state.items())
    s = lambda n: state[f"model.{n}"]  # noqa: E731
    assert torch.equal(
        model.self_attn.qkv_proj.weight,
        torch.cat([s("self_attn.q_proj.weight"), s("self_attn.k_proj.weight"), s("self_attn.v_proj.weight")]),
    )
    # encoder_attn.k_proj has no qkv_proj sibling: it goes to kv_proj; q_proj stays itself.
    assert torch.equal(
        model.encoder_attn.kv_proj.bias, torch.cat([s("encoder_attn.k_proj.bias"), s("encoder_attn.v_proj.bias")])
    )
    assert torch.equal(model.encoder_attn.q_proj.weight, s("encoder_attn.q_proj.weight"))
    assert torch.equal(model.norm.weight, s("norm.weight"))
    assert "self_attn.qkv_proj.weight" in filled and "table" not in filled  # buffers are optional


def test_generic_loader_names_missing_weights_by_their_checkpoint_names():
    state = _hf_state()
    for name in ("model.self_attn.v_proj.weight", "model.encoder_attn.k_proj.bias", "model.norm.bias"):
        del state[name]
    with pytest.raises(ValueError, match=r"^checkpoint is missing 3 weights: encoder_attn.k_proj.bias, "
                                          r"norm.bias, self_attn.v_proj.weight$"):
        load_checkpoint(_Tiny(), state.items())


def test_generic_loader_names_the_tensor_with_a_bad_shape():
    state = _hf_state()
    state["model.encoder_attn.v_proj.weight"] = rand(4, 3)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.encoder_attn.v_proj.weight' has shape "
                                          r"\(4, 3\), expected \(4, 4\)"):
        load_checkpoint(_Tiny(), state.items())
    state = _hf_state()
    state["table"] = rand(4)  # a buffer goes through default_weight_loader
    with pytest.raises(ValueError, match=r"checkpoint tensor 'table' has shape \(4,\), expected \(3,\)"):
        load_checkpoint(_Tiny(), state.items())


# -- BART at tensor-parallel size 2 ------------------------------------------------------


def _bart(cfg, rank: int | None, dtype=f64):
    """BART built the way the engine builds it (meta, cast, to_empty), as ``rank`` of 2
    (None: one rank)."""
    from tandem.backends.torch_sdpa import TorchSDPABackend
    from tandem.core.model import ModelContext
    from tandem.model_zoo.bart import BartForConditionalGeneration

    ctx = ModelContext(TorchSDPABackend, dtype, torch.device("cpu"))
    with torch.device("meta"):
        if rank is None:
            model = BartForConditionalGeneration(cfg, ctx)
        else:
            with tensor_parallel(2, rank):
                model = BartForConditionalGeneration(cfg, ctx)
    return model.to(dtype=dtype).to_empty(device="cpu")


def test_bart_loads_each_ranks_slice(bart_dir):
    from safetensors.torch import load_file

    from tandem.core.loader import load_hf_config
    from tandem.core.checkpoint import iterate_weights

    cfg, hf = load_hf_config(str(bart_dir)), load_file(bart_dir / "model.safetensors")
    d, ffn = cfg.d_model, cfg.encoder_ffn_dim
    layer = "model.encoder.layers.1"
    ranks = []
    for rank in range(2):
        model = _bart(cfg, rank)
        model.load_weights(iterate_weights(bart_dir))
        ranks.append(dict(model.named_parameters()))
        attn = model.model.encoder.layers[1].self_attn
        assert attn.attn.num_heads == cfg.encoder_attention_heads // 2
    half = lambda name, dim=0: torch.cat([r[name] for r in ranks], dim)  # noqa: E731
    for proj in range(3):  # each rank holds its half of q, of k and of v, back to back
        hf_name = f"{layer}.self_attn.{'qkv'[proj]}_proj.weight"
        parts = [r[f"{layer}.self_attn.qkv_proj.weight"].view(3, d // 2, d)[proj] for r in ranks]
        assert torch.equal(torch.cat(parts), hf[hf_name].to(f64))
    assert torch.equal(half(f"{layer}.fc1.weight"), hf[f"{layer}.fc1.weight"].to(f64))
    assert torch.equal(half(f"{layer}.fc2.weight", 1), hf[f"{layer}.fc2.weight"].to(f64))
    assert torch.equal(ranks[0][f"{layer}.fc2.bias"], ranks[1][f"{layer}.fc2.bias"])
    assert ranks[0][f"{layer}.fc1.weight"].shape == (ffn // 2, d)
    assert torch.equal(half("model.shared.weight"), hf["model.shared.weight"].to(f64))


def _tp_worker(rank: int, init_file: str, model_dir: str, result_file: str) -> None:
    """One rank of a gloo group: BART's encoder and tied LM head at tp=2 against tp=1.

    Writes "ok" or its traceback to ``result_file.<rank>`` and leaves with ``os._exit``,
    as the engine's rank processes do (``worker_proc.py``): at a normal interpreter exit
    a gloo worker thread can drop a finished collective's tensors after the GIL is gone,
    and that aborts the process (SIGABRT) after the test has passed."""
    import os
    import traceback

    try:
        _tp_compare(rank, init_file, model_dir)
        outcome = "ok"
    except BaseException:  # noqa: BLE001 - the parent reads it and fails with it
        outcome = traceback.format_exc()
    with open(f"{result_file}.{rank}", "w") as f:
        f.write(outcome)
    os._exit(0)


def _tp_compare(rank: int, init_file: str, model_dir: str) -> None:
    import torch.distributed as dist

    from tandem.core.layers import Attention
    from tandem.core.loader import load_hf_config
    from tandem.core.checkpoint import iterate_weights

    def dense_attention(self, query, key, value, kv_cache, attn_metadata):
        q, k, v = (t.view(-1, self.num_heads, self.head_size).transpose(0, 1) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_size**-0.5)  # one sequence, no mask
        return out.transpose(0, 1).reshape(-1, self.num_heads * self.head_size)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    Attention.forward = dense_attention  # the paged backends need a whole engine step
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cfg = load_hf_config(model_dir)
        ids = torch.tensor([0, 17, 5, 40, 93, 2])
        positions = torch.arange(len(ids))
        outs = []
        for r in (None, rank):
            model = _bart(cfg, r)
            model.load_weights(iterate_weights(model_dir))
            with torch.no_grad():
                hidden = model.model.encoder(ids, positions, None)
                outs.append((hidden, model.compute_logits(hidden)))
        (ref_h, ref_l), (h, logits) = outs
        assert logits.shape == ref_l.shape == (len(ids), cfg.vocab_size)
        torch.testing.assert_close(h, ref_h, rtol=0, atol=1e-9)
        torch.testing.assert_close(logits, ref_l, rtol=0, atol=1e-9)
    finally:
        # Without this barrier a rank that finishes first closes its gloo pairs while the
        # other still reads the last collective's message.
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
def test_bart_encoder_and_lm_head_at_tp2_equal_tp1_with_real_collectives(bart_dir, tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    result = tmp_path / "result"
    mp.spawn(_tp_worker, args=(str(tmp_path / "rendezvous"), str(bart_dir), str(result)), nprocs=2)
    for rank in range(2):
        assert (tmp_path / f"result.{rank}").read_text() == "ok", f"rank {rank}"
