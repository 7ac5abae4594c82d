"""The ``tandem-example-backend`` entry point: registers the backend by name, lazily."""

from tandem import hookimpl


@hookimpl
def tandem_register_attention_backends(registry) -> None:
    # "module:Class": the backend module (and its operator) is imported on first use, not here.
    registry.register_backend("example_paged", "tandem_example_backend.backend:ExamplePagedBackend")
