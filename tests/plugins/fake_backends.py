"""Backend classes the registry tests register, well and badly named."""

import torch

from tandem import AttentionBackend
from tandem.backends.torch_sdpa import TorchSDPABackend


class MyBackend(TorchSDPABackend):
    name = "my_backend"


class MisnamedBackend(TorchSDPABackend):
    name = "something_else"


class InheritsItsName(TorchSDPABackend):
    pass  # name is still "torch_sdpa"


class NotABackend:
    name = "not_a_backend"


class NamelessBackend(AttentionBackend):
    pass  # never instantiated: the registry only looks at the class


class Unprioritised(TorchSDPABackend):
    name = "unprioritised"
    priority = 0


class TiedWithMine(TorchSDPABackend):
    name = "a_tied_backend"  # same priority as MyBackend (torch_sdpa's 10)


class CudaOnlyFast(TorchSDPABackend):
    """Stands for a fast GPU backend: high priority, narrow capabilities."""

    name = "cuda_only_fast"
    priority = 100

    @classmethod
    def unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size, kv_cache_dtype):
        reasons = []
        if device.type != "cuda":
            reasons.append(f"device {device.type!r} is not cuda")
        if block_size % 16:
            reasons.append(f"block_size {block_size} is not a multiple of 16")
        if kv_cache_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"KV-cache dtype {kv_cache_dtype} is not float16 or bfloat16")
        return reasons
