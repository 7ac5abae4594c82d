"""Engine configuration, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


DEFAULT_KV_CACHE_GIB = 1.0


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    # "auto": the checkpoint's dtype on GPU; on CPU bfloat16 where native, else float32;
    # $TANDEM_AUTO_DTYPE, when set, overrides what "auto" means; with int8 "auto" is float32 (core/dtype.py).
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    # GiB for the device KV pool; None: what max_num_seqs full-length requests
    # need, at most DEFAULT_KV_CACHE_GIB.
    kv_cache_memory: float | None = None
    swap_space: float = 1.0  # GiB of CPU swap pool
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    preemption_mode: str | None = None
    attention_backend: str | None = None
    seed: int = 0
    # Never run Python code shipped inside a checkpoint (transformers' auto_map) unless asked.
    trust_remote_code: bool = False
    # Request defaults: "auto" (the checkpoint's generation_config.json, as HF
    # generate uses it), "none" (SamplingParams' own defaults), or a directory
    # holding a generation_config.json.
    generation_config: str = "auto"
    # How linear layers multiply on CPU: "auto" (oneDNN pre-packed weights where
    # they run, else F.linear), "packed", "dense" (core/layers/linear_kernels.py).
    cpu_gemm: str = "auto"
    # Host allocator on CPU: "auto" (glibc keeps freed memory for reuse instead of
    # re-mmapping every step's large tensors, unless another allocator or glibc
    # environment settings were chosen), "system" (core/worker/host_malloc.py).
    cpu_malloc: str = "auto"
    # None, or "int8": int8 weights, dynamically quantized activations (CPU).
    quantization: str | None = None
    # Failed steps in a row (no good step between) after which the engine declares
    # itself dead; each failed step fails only its own requests (core/faults.py).
    max_consecutive_step_failures: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not Path(self.model).is_dir():
            raise ValueError(f"model={self.model!r}: not a local checkpoint directory")
        self.model = str(self.model)
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be 'auto' or one of {sorted(_DTYPES)}")
        if not isinstance(self.dtype, str) and self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype={self.dtype!r}: must be 'auto', float32, bfloat16 or float16")
        if not isinstance(self.device, str) or (
            self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:")
        ):
            raise ValueError(f"device={self.device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}: CUDA is not available on this machine")
        self.torch_device = torch.device(self.device)
        from tandem.core.dtype import auto_dtype_override, resolve_auto_dtype

        # A bad $TANDEM_AUTO_DTYPE is refused whatever dtype is asked for, so a typo
        # never goes unnoticed; a valid one changes only what "auto" means.
        auto_dtype_override()
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization={self.quantization!r}: must be None or 'int8'")
        if self.dtype == "auto":
            self.torch_dtype, self.dtype_reason = resolve_auto_dtype(self.model, self.torch_device, self.quantization)
        else:
            self.torch_dtype = _DTYPES[self.dtype] if isinstance(self.dtype, str) else self.dtype
            self.dtype_reason = "asked for"
            if self.quantization == "int8" and self.torch_dtype != torch.float32:
                raise ValueError(
                    f"dtype={self.dtype!r} with quantization='int8': int8 dynamic quantization computes in "
                    "float32; use dtype='float32' or 'auto' (which means float32 with int8), or drop quantization"
                )
        if self.cpu_gemm not in ("auto", "packed", "dense"):
            raise ValueError(f"cpu_gemm={self.cpu_gemm!r}: must be 'auto', 'packed' or 'dense'")
        if self.cpu_malloc not in ("auto", "system"):
            raise ValueError(f"cpu_malloc={self.cpu_malloc!r}: must be 'auto' or 'system'")
        if not is_int(self.block_size) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size={self.block_size!r}: must be an integer in [1, 1024]")
        if self.num_kv_blocks is not None and (not is_int(self.num_kv_blocks) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r}: must be an integer >= 1")
        if self.kv_cache_memory is not None and (not is_real(self.kv_cache_memory) or self.kv_cache_memory <= 0):
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r}: must be a finite, positive number of GiB")
        if not is_real(self.swap_space) or self.swap_space < 0:
            raise ValueError(f"swap_space={self.swap_space!r}: must be a finite number of GiB >= 0")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"trust_remote_code={self.trust_remote_code!r}: must be True or False")
        if not is_int(self.max_consecutive_step_failures) or self.max_consecutive_step_failures < 1:
            raise ValueError(
                f"max_consecutive_step_failures={self.max_consecutive_step_failures!r}: must be an integer >= 1"
            )
        if not is_int(self.seed) or not -(2**63) <= self.seed <= 2**64 - 1:
            raise ValueError(f"seed={self.seed!r}: must be an integer in [-2**63, 2**64 - 1], the range torch seeds take")
        gc = self.generation_config
        if not isinstance(gc, (str, Path)) or (str(gc) not in ("auto", "none") and not Path(gc).is_dir()):
            raise ValueError(
                f"generation_config={gc!r}: must be 'auto' (the checkpoint's), 'none', or a directory "
                "holding a generation_config.json"
            )
        self.generation_config = str(gc)
        # max_num_seqs, max_num_batched_tokens and preemption_mode are checked by SchedulerConfig.
