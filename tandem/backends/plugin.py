"""tandem's own attention backends, each registered by its own entry point.

These objects import nothing heavy: a backend's module is imported only when
the registry loads it.
"""

from tandem.plugins.hookspecs import hookimpl


class BackendPlugin:
    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target

    @hookimpl
    def tandem_register_attention_backends(self, registry) -> None:
        registry.register_backend(self.name, self.target)


torch_sdpa = BackendPlugin("torch_sdpa", "tandem.backends.torch_sdpa:TorchSDPABackend")
triton = BackendPlugin("triton", "tandem.backends.triton:TritonBackend")
xformers = BackendPlugin("xformers", "tandem.backends.xformers:XFormersBackend")
flash_attn = BackendPlugin("flash_attn", "tandem.backends.flash_attn:FlashAttnBackend")
cpu_paged = BackendPlugin("cpu_paged", "tandem.backends.cpu_paged:CPUPagedBackend")
