"""Reading a checkpoint says how far it got at INFO every few seconds (a large one takes
tens of seconds before the engine's ready line)."""

from __future__ import annotations

import logging

from tandem.core import checkpoint
from tests.helpers import make_bart


def test_a_long_weight_read_logs_its_progress(tmp_path, monkeypatch, caplog):
    model_dir = make_bart(tmp_path / "bart")
    total = checkpoint.checkpoint_files(model_dir)[0].stat().st_size / 2**20
    monkeypatch.setattr(checkpoint, "PROGRESS_INTERVAL_S", 0.0)  # every tensor is "a few seconds" later
    with caplog.at_level(logging.INFO, logger="tandem.core.checkpoint"):
        tensors = list(checkpoint.iterate_weights(model_dir))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(tensors) > 1
    assert all(line.startswith(f"loading weights from {model_dir}: ") for line in lines)
    assert lines[-1].split(": ")[1].startswith(f"{sum(t.numel() * t.element_size() for _, t in tensors) / 2**20:.0f}"
                                               f" of {total:.0f} MiB (")


def test_a_quick_read_says_nothing(tmp_path, caplog):
    model_dir = make_bart(tmp_path / "bart")
    with caplog.at_level(logging.INFO, logger="tandem.core.checkpoint"):
        assert list(checkpoint.iterate_weights(model_dir))
    assert caplog.records == []
