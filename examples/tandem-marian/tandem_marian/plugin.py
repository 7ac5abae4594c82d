"""The ``tandem-marian`` entry point: tells tandem which class serves Marian checkpoints."""

from tandem import hookimpl


@hookimpl
def tandem_register_models(registry) -> None:
    # A lazy "module:Class" target: the model module is imported on first use, not here.
    registry.register_model("MarianMTModel", "tandem_marian.marian:MarianForConditionalGeneration")
