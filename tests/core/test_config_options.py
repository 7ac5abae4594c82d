"""Each engine option is spelt once: ``SchedulerConfig`` is derived from ``EngineConfig``'s
fields, and the allowed values of an option with choices are its field's, for the CLI and
for every check (issue 38)."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.core.config import SCHEDULER_OPTIONS, EngineConfig, SchedulerConfig
from tandem.core.layers.kernel_setup import prepare_linear_kernels
from tandem.core.worker.host_malloc import keep_freed_memory


def test_scheduler_config_is_engine_configs_share():
    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    sched = dataclasses.fields(SchedulerConfig)
    assert [f.name for f in sched] == list(SCHEDULER_OPTIONS)
    for f in sched:
        assert f.default == engine[f.name].default
        assert f.metadata["help"] == engine[f.name].metadata["help"]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_num_seqs=0), "max_num_seqs=0"),
    (dict(max_num_seqs=16, max_num_batched_tokens=8), "max_num_batched_tokens=8"),
    (dict(preemption_mode="evict"), "preemption_mode='evict': must be None, 'recompute' or 'swap'"),
])
def test_engine_and_scheduler_config_refuse_alike(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SchedulerConfig(**kwargs)
    with pytest.raises(ValueError, match=needle):
        EngineConfig(model="tandem/demo_model", **kwargs)


def test_engine_builds_its_scheduler_config_from_its_own_fields():
    cfg = EngineConfig(model="tandem/demo_model", max_num_seqs=3, max_num_batched_tokens=40, preemption_mode="swap")
    assert cfg.scheduler_config() == SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=40, preemption_mode="swap")


def test_every_check_of_a_choice_reads_the_fields_choices(monkeypatch):
    # Widen the field's choices: a check with its own list would still refuse the new value.
    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name, value in (("cpu_malloc", "tcmalloc"), ("cpu_gemm", "blas")):
        meta = dict(engine[name].metadata)
        meta["choices"] = (*meta["choices"], value)
        monkeypatch.setattr(engine[name], "metadata", meta)
    import torch
    from tandem.core import config

    monkeypatch.setattr(config, "_ENGINE_FIELDS", engine)
    EngineConfig(model="tandem/demo_model", cpu_malloc="tcmalloc", cpu_gemm="blas")  # no error
    # Before, each of these raised "must be 'auto' or 'system'" / "must be 'auto', 'packed' or 'dense'".
    assert "jemalloc" in keep_freed_memory("tcmalloc", environ={"LD_PRELOAD": "libjemalloc.so"})
    said = prepare_linear_kernels(torch.nn.Linear(2, 2), device=torch.device("cpu"), dtype=torch.float32, gemm="blas")
    assert isinstance(said, str)
