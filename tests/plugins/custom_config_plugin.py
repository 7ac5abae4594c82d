"""A plugin that teaches transformers' AutoConfig a new ``model_type``, as docs/plugins.md shows."""

from transformers import AutoConfig, BartConfig

from tandem import hookimpl

MODEL_TYPE = "tandem-test-bart"


class TandemTestBartConfig(BartConfig):
    model_type = MODEL_TYPE


@hookimpl
def tandem_register_models(registry) -> None:
    # The hooks run again whenever tandem refills its registries; registering a new model_type
    # again is not an error. No exist_ok=True: that would let this silently replace a model_type
    # transformers itself defines, where an error naming this plugin is what we want.
    AutoConfig.register(MODEL_TYPE, TandemTestBartConfig)
    # Checkpoints of this type name tandem's BART class in "architectures"; a plugin with its own
    # model class would register it here under its own architecture name.
    registry.register_model("TandemTestBartForConditionalGeneration",
                            "tandem.model_zoo.bart:BartForConditionalGeneration")
