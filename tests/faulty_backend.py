"""A backend that raises that raises in ``forward`` at chosen steps (fault injection).

It is torch_sdpa with a step counter: the metadata builder counts the steps it
builds for, and the impl raises ``InjectedFault`` during the steps listed in
``FaultyBackend.fail_steps`` (or every step with ``fail_always``)."""

from __future__ import annotations

from tandem.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl, TorchSDPAMetadataBuilder


class InjectedFault(RuntimeError):
    pass


class FaultyBuilder(TorchSDPAMetadataBuilder):
    def build(self, inputs):
        FaultyBackend.step += 1
        FaultyBackend.failing = FaultyBackend.fail_always or FaultyBackend.step in FaultyBackend.fail_steps
        return super().build(inputs)


class FaultyImpl(TorchSDPAImpl):
    def forward(self, *args, **kwargs):
        if FaultyBackend.failing:
            raise InjectedFault(f"injected fault at step {FaultyBackend.step}")
        return super().forward(*args, **kwargs)


class FaultyBackend(TorchSDPABackend):
    name = "faulty_sdpa"
    step = 0
    failing = False
    fail_steps: set[int] = set()
    fail_always = False

    @classmethod
    def reset(cls, fail_steps=(), fail_always: bool = False) -> None:
        cls.step, cls.failing, cls.fail_steps, cls.fail_always = 0, False, set(fail_steps), fail_always

    @classmethod
    def auto_priority(cls, device, dtype):
        return None  # never chosen unless asked for by name

    @staticmethod
    def get_impl_cls():
        return FaultyImpl

    @staticmethod
    def get_metadata_builder_cls():
        return FaultyBuilder
