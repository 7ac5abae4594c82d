"""The worker: owns the model, the KV caches and the sampler, and runs what the
scheduler decided (``Worker.execute_model``), on plain data."""

from tandem.core.worker.worker import Worker

__all__ = ["Worker"]
