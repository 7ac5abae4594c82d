"""Attention kernels side by side: every registered backend that can serve the
device, on the same paged layouts, against the memory-bandwidth floor.

Cases (the issue's shapes; 16 query heads = 16 KV heads, head size 64):

  decode   batch 64, 1 new token each on top of 1023 cached (1024 keys), decoder
           self-attention over the paged cache (blocks shuffled).
           Floor: every cached K and V byte read once at the device's peak bandwidth.
  prefill  batch 8 x 512 new tokens, nothing cached, causal decoder self-attention
           (writes its K/V into the cache too). Reported as achieved TFLOP/s
           (causal: half of the 4 * L^2 * H * D multiply-adds per sequence).
  encoder  batch 8 x 512, non-causal packed encoder self-attention (no cache).

Each backend runs its own metadata builder and impl behind tandem's ``Attention``
layer, as a model calls it; time is the median of ``--iters`` calls after
``--warmup`` (CUDA events on a GPU, perf_counter on CPU). Blocks per backend:
``--block-size`` unless the backend rejects it, then the smallest of 16, 32,
64, 128, 256 it accepts (flash-attn 2's paged kernel needs 256).

  python benchmarks/attention_kernels.py                  # every backend that can serve here
  python benchmarks/attention_kernels.py --dtype float16 --backends triton,flash_attn
  python benchmarks/attention_kernels.py --device cpu --batch-scale 0.125   # a quick CPU check

No GPU figures can come from a machine without one; docs/backends.md says which
were measured where.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import cpu_flags  # noqa: E402

from tandem.core.attention import AttentionType, KVCacheSpec, StepInputs  # noqa: E402
from tandem.core.layers import Attention  # noqa: E402
from tandem.plugins import default_backend_registry  # noqa: E402

# Peak memory bandwidth in bytes/s by device name (datasheet figures).
PEAK_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12}


def _peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def layout(batch: int, q_len: int, seq_len: int, block_size: int, device, gen) -> StepInputs:
    """``batch`` sequences of ``q_len`` new tokens after ``seq_len - q_len`` cached,
    tables of shuffled blocks; no encoder runs (cross tables unused, one block)."""
    blocks_per_seq = -(-seq_len // block_size)
    perm = torch.randperm(batch * blocks_per_seq + 1, generator=gen)[: batch * blocks_per_seq]
    tables = perm.view(batch, blocks_per_seq)
    pos = torch.arange(seq_len - q_len, seq_len)
    slots = (tables[:, pos // block_size] * block_size + pos % block_size).flatten()
    qsl = torch.arange(batch + 1) * q_len
    empty = torch.zeros(0, dtype=torch.long)
    inputs = StepInputs(
        input_ids=torch.zeros(batch * q_len, dtype=torch.long),
        positions=pos.repeat(batch),
        slot_mapping=slots,
        query_lens=[q_len] * batch,
        seq_lens=[seq_len] * batch,
        query_start_loc=qsl,
        block_tables=tables,
        encoder_input_ids=empty,
        encoder_positions=empty,
        encoder_seq_lens=[],
        cross_slot_mapping=empty,
        cross_seq_lens=[1] * batch,
        cross_block_tables=torch.zeros(batch, 1, dtype=torch.long),
        logits_indices=qsl[1:] - 1,
    )
    return StepInputs(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(inputs).items()})


def encoder_layout(batch: int, length: int, device) -> StepInputs:
    one = layout(1, 1, 1, 1, "cpu", torch.Generator().manual_seed(0))
    one.encoder_seq_lens = [length] * batch
    one.encoder_input_ids = torch.zeros(batch * length, dtype=torch.long)
    one.encoder_positions = torch.arange(length).repeat(batch)
    one.cross_slot_mapping = torch.zeros(batch * length, dtype=torch.long)  # unused by encoder attention
    return StepInputs(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(one).items()})


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn, iters):
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
    else:
        def run(fn, iters):
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times)
    return run


def _block_size(backend, args, device, dtype) -> int | None:
    kinds = frozenset(AttentionType)
    for bs in [args.block_size, 16, 32, 64, 128, 256]:
        if not backend.unsupported_reasons(device, dtype, args.head_size, kinds, bs, dtype):
            return bs
    return None


def bench_backend(name: str, args, device, dtype) -> dict:
    try:
        backend = default_backend_registry().load(name)
    except ImportError as e:
        return {"backend": name, "skipped": str(e)}
    bs = _block_size(backend, args, device, dtype)
    if bs is None:
        reasons = backend.unsupported_reasons(device, dtype, args.head_size, frozenset(AttentionType),
                                              args.block_size, dtype)
        return {"backend": name, "skipped": "; ".join(reasons)}
    H, D = args.heads, args.head_size
    gen = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(1, H, D)
    builder = backend.get_metadata_builder_cls()(bs, device, spec)
    run = _timer(device)
    row = {"backend": name, "block_size": bs}

    def one(kind, inputs, q_tokens, kv_tokens, num_blocks):
        layer = Attention(H, D, D**-0.5, backend, kind, H).to(device)
        md = builder.build(inputs)
        cache = None
        if kind is not AttentionType.ENCODER:
            cache = backend.allocate_kv_cache(num_blocks, bs, H, D, dtype, device)
            cache.normal_()
        q = torch.randn(q_tokens, H * D, device=device, dtype=dtype)
        k = torch.randn(kv_tokens, H * D, device=device, dtype=dtype)
        v = torch.randn(kv_tokens, H * D, device=device, dtype=dtype)

        def call():
            layer(q, k, v, cache, md)

        for _ in range(args.warmup):
            call()
        return run(call, args.iters)

    b, L = args.decode_batch, args.decode_len
    dec = layout(b, 1, L, bs, device, gen)
    row["decode_s"] = one(AttentionType.DECODER, dec, b, b, b * -(-L // bs) + 1)
    pb, pl = args.prefill_batch, args.prefill_len
    pre = layout(pb, pl, pl, bs, device, gen)
    row["prefill_s"] = one(AttentionType.DECODER, pre, pb * pl, pb * pl, pb * -(-pl // bs) + 1)
    enc = encoder_layout(pb, pl, device)
    row["encoder_s"] = one(AttentionType.ENCODER, enc, pb * pl, pb * pl, 0)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--backends", default=None, help="comma list (default: every registered one)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--batch-scale", type=float, default=1.0, help="scale the batch sizes (quick CPU runs)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    args.decode_batch = max(1, round(64 * args.batch_scale))
    args.decode_len = 1024
    args.prefill_batch = max(1, round(8 * args.batch_scale))
    args.prefill_len = 512
    names = args.backends.split(",") if args.backends else default_backend_registry().names()

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# device {dev_name} | torch {torch.__version__} | dtype {str(dtype).removeprefix('torch.')} | "
          f"cpu_flags {cpu_flags()} | heads {args.heads} x {args.head_size}")
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * args.decode_batch * args.decode_len * args.heads * args.head_size * elem
    peak = _peak_bandwidth(device)
    floor = kv_bytes / peak if peak else None
    flops = 2 * 2 * args.prefill_batch * args.prefill_len**2 * args.heads * args.head_size  # QK^T and PV
    print(f"# decode: batch {args.decode_batch} x {args.decode_len} keys, K/V {kv_bytes / 1e6:.0f} MB"
          + (f", bandwidth floor {floor * 1e6:.1f} us at {peak / 1e12:.2f} TB/s" if floor else ""))
    print(f"# prefill / encoder: batch {args.prefill_batch} x {args.prefill_len}")
    print()
    print(f"| backend | block | decode us | floor / decode | prefill ms | prefill TFLOP/s | encoder ms | encoder TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        row = bench_backend(name, args, device, dtype)
        if "skipped" in row:
            print(f"| {name} | - | skipped: {row['skipped']} | | | | | |")
            continue
        eff = f"{floor / row['decode_s']:.0%}" if floor else "n/a"
        print(f"| {name} | {row['block_size']} | {row['decode_s'] * 1e6:.1f} | {eff} | "
              f"{row['prefill_s'] * 1e3:.2f} | {flops / 2 / row['prefill_s'] / 1e12:.2f} | "
              f"{row['encoder_s'] * 1e3:.2f} | {flops / row['encoder_s'] / 1e12:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
