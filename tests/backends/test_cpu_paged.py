"""cpu_paged: its C++ decode op against a float64 reference on realistic shapes
(with and without a position bias),
its argument checks, and the fallback to torch_sdpa where the op cannot build.
(The conformance suite runs it through every attention kind and step mix.)"""

from __future__ import annotations

import pytest
import torch

from tandem.backends.cpu_paged import ops
from tandem.core.attention import AttentionType
from tandem.plugins import default_backend_registry

try:
    OP = ops.load()
except ops.CPUOpUnavailable as e:  # no compiler here: only the fallback tests run
    OP, WHY = None, str(e)
needs_op = pytest.mark.skipif(OP is None, reason="cpu_paged's C++ op is unavailable here")


def _layout(lens, num_kv_heads, head_size, block_size, dtype, seed):
    """A cache holding each sequence's keys in shuffled blocks, and its block table."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // block_size) for n in lens]
    total = sum(n_blocks) + 3  # spare blocks hold garbage the op must not read
    cache = (torch.randn(2, total, block_size, num_kv_heads, head_size, generator=g) * 2).to(dtype)
    perm = torch.randperm(total, generator=g).tolist()
    tables = torch.full((len(lens), max(n_blocks) + 2), perm[-1], dtype=torch.long)  # padded with a live id
    for i, n in enumerate(n_blocks):
        tables[i, :n] = torch.tensor(perm[:n])
        del perm[:n]
    return cache, tables


def _reference(q, cache, tables, lens, scale, group, bias=None):
    """float64 attention of each query row over its sequence's first ``lens`` keys;
    ``bias`` [H, W]: the op's position-bias row, key ``n`` of a length-``L`` sequence
    at column ``W - L + n`` (its query is at ``L - 1``: the bias is by distance)."""
    block_size = cache.shape[2]
    out = []
    for i, n in enumerate(lens):
        blocks = tables[i, : -(-n // block_size)]
        k, v = (cache[j, blocks].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1) for j in (0, 1))
        w = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
        if bias is not None:
            w = w + bias[:, bias.shape[1] - n :].double()
        out.append(torch.einsum("hl,lhd->hd", w.softmax(-1), v))
    return torch.stack(out)


@needs_op
@pytest.mark.parametrize("num_heads,num_kv_heads", [(12, 12), (8, 2), (16, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_matches_float64_on_bart_sized_heads(num_heads, num_kv_heads, block_size):
    lens = [1, 7, 16, 17, 63, 300, 512]
    D, scale = 64, 64 ** -0.5
    cache, tables = _layout(lens, num_kv_heads, D, block_size, torch.float32, seed=block_size)
    q = torch.randn(len(lens), num_heads, D, generator=torch.Generator().manual_seed(1))
    out = torch.empty_like(q)
    rows = seqs = torch.arange(len(lens))
    OP(q, cache, out, rows, seqs, torch.tensor(lens), tables, scale)
    ref = _reference(q, cache, tables, lens, scale, num_heads // num_kv_heads)
    # Softmax-weighted means of at most 512 values (|v| < ~10) after 64-term dot
    # products: float32 rounding grows like sqrt(L) * u * max|v| ~ 1.4e-5 at L = 512.
    torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=1e-4)


@needs_op
@pytest.mark.parametrize("num_kv_heads", [12, 6, 5, 3])
def test_every_head_is_computed_for_any_batch_and_thread_count(num_kv_heads):
    # The op splits a small batch's heads into runs to feed the threads; the split
    # depends on batch size and thread count, so sweep both (12 KV heads over 8 wanted
    # tasks once made runs of 2 starting past the last head).
    D, scale, threads = 16, 0.25, torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3, 5, 8):
            torch.set_num_threads(n_threads)
            for batch in range(1, 10):
                lens = [1 + (7 * i) % 23 for i in range(batch)]
                cache, tables = _layout(lens, num_kv_heads, D, 4, torch.float32, seed=batch)
                q = torch.randn(batch, num_kv_heads, D, generator=torch.Generator().manual_seed(batch))
                out = torch.full_like(q, float("nan"))  # a head left unwritten stays NaN
                rows = seqs = torch.arange(batch)
                OP(q, cache, out, rows, seqs, torch.tensor(lens), tables, scale)
                ref = _reference(q, cache, tables, lens, scale, 1)
                torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=1e-4,
                                           msg=lambda m: f"threads={n_threads} batch={batch}: {m}")
    finally:
        torch.set_num_threads(threads)


@needs_op
def test_reads_strided_queries_and_writes_only_the_decode_rows():
    """Queries arrive as views of a fused projection; rows and sequences are picked
    by index, so a batch can mix prefills (other rows) with decodes."""
    lens = [5, 40, 19]
    cache, tables = _layout(lens, 4, 32, 16, torch.float32, seed=3)
    qkv = torch.randn(6, 3, 4, 32)  # [T, q/k/v, H, D]: query = qkv[:, 0] is strided
    q = qkv[:, 0]
    out = torch.full((6, 4, 32), 7.0)
    rows, seqs = torch.tensor([4, 0, 2]), torch.tensor([2, 0, 1])  # decode rows in any order
    OP(q, cache, out, rows, seqs, torch.tensor(lens), tables, 0.2)
    ref = _reference(q[rows], cache, tables[seqs], [lens[i] for i in seqs], 0.2, 1)
    torch.testing.assert_close(out[rows].double(), ref, atol=2e-5, rtol=1e-4)
    untouched = [r for r in range(6) if r not in rows.tolist()]
    assert torch.equal(out[untouched], torch.full((len(untouched), 4, 32), 7.0))


@needs_op
@pytest.mark.parametrize("head_size", [8, 16, 24, 40, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_score_pass_on_any_head_size_and_storage(head_size, dtype):
    """The score pass runs in vectors where the head size is a multiple of the
    vector width (8 lanes on AVX2, 16 on AVX-512) and the storage has a vector load,
    and in the scalar loop elsewhere; the vector pass reduces the dot products of up
    to a vector's worth of keys at once, so lengths around that width (a partial
    run, one full run, one more key) and block sizes of 16 and 32 (two runs per
    block) are swept. Every case against float64, and groups bit for bit as alone."""
    lens = [1, 7, 8, 9, 15, 16, 17, 31, 33, 100]
    for block_size in (16, 32):
        cache, tables = _layout(lens, 2, head_size, block_size, dtype, seed=head_size + block_size)
        g = torch.Generator().manual_seed(head_size)
        q = (torch.randn(len(lens), 4, head_size, generator=g)).to(dtype)
        out = torch.empty_like(q)
        rows = seqs = torch.arange(len(lens))
        scale = head_size ** -0.5
        OP(q, cache, out, rows, seqs, torch.tensor(lens), tables, scale)
        ref = _reference(q, cache, tables, lens, scale, 2)
        if dtype is torch.float32:  # as test_matches_float64_on_bart_sized_heads (at most 128-term dots)
            torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=1e-4)
        else:  # the same stored values on both sides; the output rounds to 8 (bf16) or 11 (fp16) bits
            rtol = 2 ** -8 if dtype is torch.bfloat16 else 2 ** -10
            torch.testing.assert_close(out.double(), ref, atol=rtol * 4, rtol=rtol)
        # Two requests' four rows each over one table, as beams: bit for bit the rows alone.
        bseqs = torch.tensor([3, 3, 3, 3, 9, 9, 9, 9])
        bq = (torch.randn(8, 4, head_size, generator=g)).to(dtype)
        alone, grouped = torch.empty_like(bq), torch.empty_like(bq)
        OP(bq, cache, alone, torch.arange(8), bseqs, torch.tensor(lens), tables, scale)
        OP(bq, cache, grouped, torch.arange(8), bseqs, torch.tensor(lens), tables, scale, None, torch.tensor([0, 4, 8]))
        assert torch.equal(grouped, alone)


@needs_op
def test_tasks_of_unequal_cost_give_the_same_result_on_any_thread_count():
    """Tasks go to threads by cost (largest first, to the least loaded thread), so
    which thread runs a row changes with the thread count and the batch: its result
    must not. Groups of 4 beams and single rows over 3-500 keys, bit for bit against
    one thread, and against float64."""
    lens = [500, 3, 260, 64, 17, 420, 1, 90]
    cache, tables = _layout(lens, 12, 64, 16, torch.float32, seed=21)
    seqs = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 4, 5, 5, 5, 5, 6, 7])
    groups = torch.tensor([0, 4, 5, 9, 10, 11, 15, 16, 17])
    q = torch.randn(len(seqs), 12, 64, generator=torch.Generator().manual_seed(22))
    rows = torch.arange(len(seqs))
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2, 3, 4, 7):
            torch.set_num_threads(n)
            for grouped in (None, groups):
                out = torch.full_like(q, float("nan"))
                OP(q, cache, out, rows, seqs, torch.tensor(lens), tables, 0.125, None, grouped)
                results[n, grouped is not None] = out
    finally:
        torch.set_num_threads(threads)
    for key, out in results.items():
        assert torch.equal(out, results[1, False]), f"threads, grouped = {key}"
    ref = _reference(q, cache, tables[seqs], [lens[i] for i in seqs], 0.125, 1)
    torch.testing.assert_close(results[1, False].double(), ref, atol=5e-5, rtol=1e-4)


@needs_op
def test_many_short_tasks_in_contiguous_runs_give_the_same_result_on_any_thread_count():
    """Where no task is large (a batch of many short sequences), threads take
    contiguous runs of about equal cost instead of the sorted lists: every row bit
    for bit as on one thread (tiny heads, 1-40 keys), and against float64."""
    lens = [1 + (13 * i) % 40 for i in range(96)]
    cache, tables = _layout(lens, 4, 16, 16, torch.float32, seed=31)
    q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(32))
    rows = seqs = torch.arange(len(lens))
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2, 3, 5, 8):
            torch.set_num_threads(n)
            out = torch.full_like(q, float("nan"))
            OP(q, cache, out, rows, seqs, torch.tensor(lens), tables, 0.25)
            results[n] = out
    finally:
        torch.set_num_threads(threads)
    for n, out in results.items():
        assert torch.equal(out, results[1]), f"threads = {n}"
    ref = _reference(q, cache, tables, lens, 0.25, 1)
    torch.testing.assert_close(results[1].double(), ref, atol=5e-5, rtol=1e-4)


@needs_op
def test_bfloat16_storage_with_float32_arithmetic():
    lens = [3, 90, 200]
    cache, tables = _layout(lens, 2, 64, 16, torch.bfloat16, seed=5)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    out = torch.empty_like(q)
    OP(q, cache, out, torch.arange(3), torch.arange(3), torch.tensor(lens), tables, 0.125)
    ref = _reference(q, cache, tables, lens, 0.125, 2)
    # Inputs are the same bf16 values on both sides; what differs is the output's
    # rounding to bf16 (2^-9 relative) over float32 arithmetic.
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=2 ** -8)


@needs_op
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_bias_is_added_by_distance_on_t5_sized_heads(num_heads, num_kv_heads, dtype):
    """T5-small's decode: 8 heads x 64, no score scaling, a bias row wider than any sequence
    (the step's longest may be a prefill), read right-aligned by every sequence."""
    lens = [1, 7, 16, 17, 130, 300]
    D, width = 64, 320
    cache, tables = _layout(lens, num_kv_heads, D, 16, dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    q = (torch.randn(len(lens), num_heads, D, generator=g) * 0.2).to(dtype)
    bias = torch.randn(num_heads, width, generator=g) * 3  # T5's learned biases are O(1-10)
    out = torch.empty_like(q)
    OP(q, cache, out, torch.arange(len(lens)), torch.arange(len(lens)), torch.tensor(lens), tables, 1.0, bias)
    ref = _reference(q, cache, tables, lens, 1.0, num_heads // num_kv_heads, bias)
    if dtype is torch.float32:
        # As without a bias (float32 sums of <= 300 terms; |v| < ~10): the bias adds one float32
        # rounding per score, ~6e-8 relative, before the softmax.
        torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=1e-4)
    else:
        # The same bf16 inputs on both sides; the output's rounding to bf16 (2^-9 relative).
        torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=2 ** -8)
    # Without the bias the answer differs: the row is not ignored.
    plain = torch.empty_like(q)
    OP(q, cache, plain, torch.arange(len(lens)), torch.arange(len(lens)), torch.tensor(lens), tables, 1.0)
    assert (plain.double() - ref).abs().max() > 0.1


@needs_op
def test_a_one_key_step_takes_a_width_one_row_of_any_stride():
    """A step whose longest sequence has one key (beam search's first decode from ``[pad]``)
    builds an ``[H, 1]`` row whose column stride is not 1 (a column of an ``[H, W]`` view);
    a width-one row has no layout to check, and the op takes it."""
    cache, tables = _layout([1, 1], 2, 16, 4, torch.float32, seed=0)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    row = torch.randn(1, 4, generator=torch.Generator().manual_seed(2)).t()  # [4, 1], strides (1, 4)
    assert row.stride(1) != 1
    out = torch.empty_like(q)
    OP(q, cache, out, torch.arange(2), torch.arange(2), torch.tensor([1, 1]), tables, 1.0, row)
    ref = _reference(q, cache, tables, [1, 1], 1.0, 2, row.contiguous())
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)  # one key: softmax is 1, out = v


@needs_op
@pytest.mark.parametrize("num_heads,num_kv_heads", [(12, 12), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_sharing_a_table_attend_as_one_group(num_heads, num_kv_heads, dtype):
    """A request's beams (and n > 1 samples) read one cross table: passed as groups
    (``kv_groups``), each group's rows are served by one task that reads the K/V once.
    Every row must still get its own attention: the float64 reference per row, and
    bit for bit what the op gives the same rows ungrouped. Groups of 4, 1 and 3 rows
    in a scattered row order, sizes that leave the threads a head split or not."""
    lens = [300, 7, 130]  # one table per request
    D, scale = 64, 64 ** -0.5
    cache, tables = _layout(lens, num_kv_heads, D, 16, dtype, seed=11)
    seqs = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2])  # request of each decode row
    rows = torch.tensor([9, 2, 5, 0, 7, 1, 3, 8])  # where each sits in the packed batch
    q = (torch.randn(10, num_heads, D, generator=torch.Generator().manual_seed(12))).to(dtype)
    grouped, alone = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    OP(q, cache, alone, rows, seqs, torch.tensor(lens), tables, scale)
    OP(q, cache, grouped, rows, seqs, torch.tensor(lens), tables, scale, None, torch.tensor([0, 4, 5, 8]))
    assert torch.equal(grouped, alone)
    ref = _reference(q[rows], cache, tables[seqs], [lens[i] for i in seqs], scale, num_heads // num_kv_heads)
    if dtype is torch.float32:
        torch.testing.assert_close(grouped[rows].double(), ref, atol=5e-5, rtol=1e-4)  # as the ungrouped test
    else:
        torch.testing.assert_close(grouped[rows].double(), ref, atol=1e-2, rtol=2 ** -8)
    assert torch.equal(grouped[[4, 6]], torch.full((2, num_heads, D), 7.0, dtype=dtype))  # no other row written


@needs_op
@pytest.mark.parametrize("groups,message", [
    (torch.tensor([0, 2, 3], dtype=torch.int32), "kv_groups must be a contiguous 1-D int64"),
    (torch.tensor([0, 2]), "kv_groups must run from 0 to the 3 rows, got 0 to 2"),
    (torch.tensor([1, 3]), "kv_groups must run from 0 to the 3 rows, got 1 to 3"),
    (torch.tensor([0, 2, 2, 3]), "kv_groups must increase strictly, got 2 then 2"),
], ids=["dtype", "short", "start", "empty-group"])
def test_bad_kv_groups_raise_naming_the_problem(groups, message):
    cache, tables = _layout([4, 9], 2, 16, 4, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match=message):
        OP(torch.randn(3, 4, 16), cache, torch.empty(3, 4, 16), torch.arange(3), torch.tensor([0, 0, 1]),
           torch.tensor([4, 9]), tables, 0.25, None, groups)


def test_shared_runs_finds_adjacent_rows_with_one_table():
    from tandem.backends.cpu_paged.backend import shared_runs

    t = torch.tensor([[5, 6], [5, 6], [5, 6], [1, 2], [5, 6], [5, 6], [5, 7]])
    lens = torch.tensor([20, 20, 20, 20, 20, 19, 20])
    # Rows 4 and 5 share blocks but not a length (never the case for one request; not grouped).
    assert shared_runs(t, lens).tolist() == [0, 3, 4, 5, 6, 7]
    assert shared_runs(t[3:5], lens[3:5]) is None  # nothing shared: the op's plain path
    assert shared_runs(t[:1], lens[:1]) is None


@needs_op
@pytest.mark.parametrize("bias,message", [
    (torch.zeros(4, 9, dtype=torch.float64), "position_bias must be a float32"),
    (torch.zeros(4, 9).t(), "position_bias must be a float32"),
    (torch.zeros(3, 9), "position_bias has 3 heads, the query 4"),
    (torch.zeros(4, 8), "sequence 1 has 9 keys, more than position_bias's width 8"),
], ids=["dtype", "layout", "heads", "width"])
def test_a_bad_position_bias_raises_naming_the_problem(bias, message):
    cache, tables = _layout([4, 9], 2, 16, 4, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match=message):
        OP(torch.randn(2, 4, 16), cache, torch.empty(2, 4, 16), torch.arange(2), torch.arange(2),
           torch.tensor([4, 9]), tables, 0.25, bias)


@needs_op
@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(query=a["query"].double(), out=a["out"].double()), "must share one dtype"),
        (lambda a: a.update(kv_cache=a["kv_cache"][0]), "kv_cache must be"),
        (lambda a: a.update(block_tables=a["block_tables"].int()), "int64"),
        (lambda a: a.update(query=a["query"][:, :3], out=a["out"][:, :3]), "KV heads"),
        (lambda a: a.update(seqs=a["seqs"][:1]), "differ in length"),
    ],
    ids=["dtype", "cache-shape", "index-dtype", "heads", "lengths"],
)
def test_bad_arguments_raise_naming_the_problem(change, message):
    cache, tables = _layout([4, 9], 2, 16, 4, torch.float32, seed=0)
    args = dict(query=torch.randn(2, 4, 16), kv_cache=cache, out=torch.empty(2, 4, 16), q_rows=torch.arange(2),
                seqs=torch.arange(2), kv_lens=torch.tensor([4, 9]), block_tables=tables)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        OP(*args.values(), 0.25)


def test_without_a_compiler_it_steps_aside_for_torch_sdpa(monkeypatch):
    monkeypatch.setattr(ops, "_op", None)
    monkeypatch.setattr(ops, "_error", None)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    reg = default_backend_registry()
    selection = reg.select(None, device=torch.device("cpu"), dtype=torch.float32, head_size=64,
                           attn_types=frozenset(AttentionType), block_size=16)
    assert selection.backend.name == "torch_sdpa"
    assert "cpu_paged (priority 15): its C++ op is unavailable: no C++ compiler ('/nonexistent/c++'" in selection.reason
    with pytest.raises(Exception, match="attention_backend='cpu_paged' cannot serve this model: .*no C.. compiler"):
        reg.select("cpu_paged", device=torch.device("cpu"), dtype=torch.float32, head_size=64,
                   attn_types=frozenset(AttentionType), block_size=16)


def test_not_chosen_off_cpu():
    backend = default_backend_registry().load("cpu_paged")
    assert backend.auto_priority(torch.device("cuda"), torch.bfloat16) is None
    reasons = backend.unsupported_reasons(torch.device("cuda"), torch.bfloat16, 64, frozenset(AttentionType), 16,
                                          torch.bfloat16)
    assert reasons == ["device 'cuda' is not cpu"]


class _Built(Exception):
    pass


@pytest.mark.parametrize("capability, variant, isa_flags", [
    ("AVX512", "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]),
    ("AVX2", "avx2", ["-mavx2", "-mfma"]),
    ("DEFAULT", "generic", []),
    ("ZVECTOR", "generic", []),
])
def test_the_build_targets_the_capability_torch_reports(monkeypatch, tmp_path, capability, variant, isa_flags):
    """Each branch, whatever this machine's: torch's capability (which ATEN_CPU_CAPABILITY
    lowers) picks the flags and the library's name, so variants never share a cache entry."""
    from torch.utils import cpp_extension

    seen = {}

    def fake_load(**kwargs):
        seen.update(kwargs)
        raise _Built

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing cached: the builder is called
    monkeypatch.setattr(ops, "cpu_capability", lambda: capability)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with pytest.raises(_Built):
        ops._build()
    assert ops.isa() == variant and ops.library_name() == f"tandem_cpu_paged_{variant}"
    assert seen["name"].startswith(f"tandem_cpu_paged_{variant}_") and seen["build_directory"].startswith(str(tmp_path))
    assert [f for f in seen["extra_cflags"] if f.startswith("-m")] == isa_flags


def test_the_capability_follows_aten_cpu_capability():
    import os
    import subprocess
    import sys

    code = "from tandem.backends.cpu_paged import ops; print(ops.cpu_capability(), ops.library_name())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["DEFAULT", "tandem_cpu_paged_generic"]


@needs_op
def test_the_loaded_op_is_this_capability_s_build():
    from pathlib import Path

    names = [Path(p).name for p in torch.ops.loaded_libraries]
    assert any(n.startswith(f"{ops.library_name()}_") and n.endswith(".so") for n in names), (ops.cpu_capability(),
                                                                                              names)


def test_available_says_whether_load_succeeds(monkeypatch):
    assert ops.available() == (OP is not None)
    monkeypatch.setattr(ops, "_op", None)
    monkeypatch.setattr(ops, "_error", "building the C++ op failed: no")
    assert ops.available() is False


@needs_op
def test_beam_and_n_sampled_rows_attend_to_their_cross_table_as_groups(bart_dir, monkeypatch):
    """In an engine run, a request's beams and its n > 1 samples (adjacent decodes over one
    cross table) reach the op as groups, and the results are those of torch_sdpa (one
    gathered attention per row: an independent path) and, for beams, of HF's beam search."""
    from helpers import hf_search

    from tandem import LLM, SamplingParams
    from tandem.backends.cpu_paged.backend import CPUPagedMetadataBuilder

    sizes = []
    build = CPUPagedMetadataBuilder.build

    def recording(self, inputs):
        md = build(self, inputs)
        if md.cross_groups is not None:
            sizes.extend(md.cross_groups.diff().tolist())
        return md

    monkeypatch.setattr(CPUPagedMetadataBuilder, "build", recording)
    prompts = [[0, 5, 9, 33, 17, 2], [0, 41, 8, 2], [0] + list(range(10, 50)) + [2]]
    beam = SamplingParams(num_beams=4, n=2, max_tokens=10, length_penalty=1.0)
    sampled = SamplingParams(n=3, temperature=0.8, max_tokens=10, seed=5, ignore_eos=True)
    params = [beam, sampled, beam]
    outs = {}
    for backend in ("cpu_paged", "torch_sdpa"):
        llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", attention_backend=backend)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[backend] = [[c.token_ids for c in r.outputs] for r in res]
        del llm
    assert 4 in sizes and 3 in sizes  # beams and samples were grouped
    assert outs["cpu_paged"] == outs["torch_sdpa"]
    for i in (0, 2):
        ref = hf_search(bart_dir, prompts[i], [2, 0], do_sample=False, num_beams=4, num_return_sequences=2,
                        max_new_tokens=10, length_penalty=1.0)
        assert outs["cpu_paged"][i] == [tokens for tokens, _ in ref[:2]]


def _impl():
    from tandem.backends.cpu_paged.backend import CPUPagedImpl

    return CPUPagedImpl(4, 16, 0.25, 4)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 1300])  # 1300: more than one thread's share
def test_write_slots_puts_each_token_where_index_copy_does(dtype, tokens):
    """The op's write against core's (two index_copy_ calls), bit for bit, with keys read
    from a fused projection's strided output as the layers hand them over; slots never
    written keep their bytes."""
    from tandem.core.kv.cache_ops import write_to_paged_cache

    g = torch.Generator().manual_seed(tokens)
    cache = torch.randn(2, 200, 16, 4, 16, generator=g).to(dtype)
    qkv = torch.randn(tokens, 3, 4, 16, generator=g).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]  # strided along tokens, each token's heads contiguous
    slots = torch.randperm(200 * 16, generator=g)[:tokens]
    expected = cache.clone()
    write_to_paged_cache(key, value, expected, slots)
    got = cache.clone()
    torch.ops.tandem_cpu.write_slots(key, value, got, slots)
    assert torch.equal(got, expected)
    # And through the backend's write, which takes the op here.
    again = cache.clone()
    _impl().write_kv_cache(key, value, again, slots)
    assert torch.equal(again, expected)


@needs_op
def test_write_kv_cache_falls_back_where_the_op_does_not_apply():
    """A key to convert (float32 into a bfloat16 cache) or an fp8 cache: core's write
    serves, with its conversion."""
    from tandem.core.kv.cache_ops import write_to_paged_cache

    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(5, 4, 16, generator=g), torch.randn(5, 4, 16, generator=g)
    slots = torch.tensor([3, 40, 41, 7, 100])
    cache = torch.zeros(2, 10, 16, 4, 16, dtype=torch.bfloat16)
    expected = cache.clone()
    write_to_paged_cache(key, value, expected, slots)
    _impl().write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected) and cache.abs().sum() > 0
    impl = _impl()
    fp8_cache = torch.zeros(2, 10, 16, 4, 16, dtype=torch.float8_e4m3fn)
    impl.write_kv_cache(key, value, fp8_cache, slots)  # calibrates the scales on this first write
    back = fp8_cache.view(2, -1, 4, 16)[0, slots].float() * impl.kv_scales.k_scale
    assert torch.allclose(back, key, rtol=0.07, atol=0.07 * float(key.abs().max()))  # e4m3: 3 mantissa bits


@needs_op
@pytest.mark.parametrize("change,message", [
    (lambda k, v, c, s: (k, v, c, torch.tensor([0, 1, 2, 16 * 10])), "slot 160 of token 3 is outside"),
    (lambda k, v, c, s: (k, v, c, torch.tensor([0, -1, 2, 3])), "slot -1 of token 1"),
    (lambda k, v, c, s: (k.double(), v, c, s), "must have kv_cache's dtype"),
    (lambda k, v, c, s: (k, v, c, s[:3]), "one slot per token"),
    (lambda k, v, c, s: (k.transpose(1, 2).contiguous().transpose(1, 2), v, c, s), "heads contiguous"),
    (lambda k, v, c, s: (k, v, c[:, :5], s), "must be a contiguous"),
])
def test_write_slots_rejects_bad_arguments_before_writing(change, message):
    cache = torch.zeros(2, 10, 16, 4, 16)
    key, value, slots = torch.ones(4, 4, 16), torch.ones(4, 4, 16), torch.tensor([0, 1, 2, 3])
    args = change(key, value, cache, slots)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tandem_cpu.write_slots(*args)
    assert cache.abs().sum() == 0  # nothing was written
