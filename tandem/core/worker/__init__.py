"""The worker: owns the model, the KV caches and the sampler, and runs what the
scheduler decided (``worker.Worker.execute_model``), on plain data."""
