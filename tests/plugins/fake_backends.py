"""Backend classes the registry tests register, well and badly named."""

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
