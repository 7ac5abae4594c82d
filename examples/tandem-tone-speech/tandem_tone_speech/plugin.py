"""The ``tandem-tone-speech`` entry point: its config type for transformers' AutoConfig,
and the class that serves its checkpoints."""

from tandem import hookimpl

ARCHITECTURE = "ToneSpeechForConditionalGeneration"


@hookimpl
def tandem_register_models(registry) -> None:
    from transformers import AutoConfig

    from tandem_tone_speech.config import MODEL_TYPE, ToneSpeechConfig

    # The hooks run again whenever tandem refills its registries: registering the same
    # model_type again is not an error.
    AutoConfig.register(MODEL_TYPE, ToneSpeechConfig)
    # A lazy "module:Class" target: the model module is imported on first use, not here.
    registry.register_model(ARCHITECTURE, "tandem_tone_speech.model:ToneSpeechForConditionalGeneration")
