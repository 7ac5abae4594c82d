"""The parallel options are checked at construction, before any worker process starts:
each bad value is a ValueError naming it."""

import importlib.util

import pytest

from tandem import LLM
from tandem.core.config import EngineConfig


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_tensor_parallel_size_must_be_a_positive_integer(bart_dir, bad):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={bad!r}: must be an integer >= 1"):
        EngineConfig(model=str(bart_dir), tensor_parallel_size=bad)


def test_backend_names_are_checked_and_default_to_mp_beyond_one_rank(bart_dir):
    with pytest.raises(ValueError, match=r"distributed_executor_backend='threads': must be None, 'mp' or 'ray'"):
        EngineConfig(model=str(bart_dir), distributed_executor_backend="threads")
    assert EngineConfig(model=str(bart_dir)).distributed_executor_backend is None
    assert EngineConfig(model=str(bart_dir), tensor_parallel_size=2).distributed_executor_backend == "mp"


def test_ray_without_ray_is_a_clear_error(bart_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray': Ray is not installed; "
                                         r"pip install 'tandem-engine\[ray\]'"):
        EngineConfig(model=str(bart_dir), distributed_executor_backend="ray")


def test_a_size_that_does_not_split_the_heads_names_the_config_field(bart_dir):
    # The tiny BART has 4 heads: 3 ranks cannot share them. Refused before a process starts.
    with pytest.raises(ValueError, match=r"config.json: encoder_attention_heads=4 is not divisible by "
                                         r"tensor_parallel_size=3"):
        LLM(model=str(bart_dir), dtype="float32", device="cpu", tensor_parallel_size=3)


def test_the_options_are_flags_and_keywords(bart_dir):
    import argparse

    from tandem.core.engine_args import add_cli_args, from_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    kwargs = from_cli_args(args)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "mp"
