"""tandem's own models. The table below is what the ``tandem-models`` plugin registers;
model modules are imported only when a checkpoint names one of their architectures."""

# "<architecture in config.json>": ("<module in tandem.model_zoo>", "<class>")
_CONDITIONAL_GENERATION_MODELS: dict[str, tuple[str, str]] = {
    "BartModel": ("bart", "BartForConditionalGeneration"),
    "BartForConditionalGeneration": ("bart", "BartForConditionalGeneration"),
    "MBartForConditionalGeneration": ("bart_family", "MBartForConditionalGeneration"),
    "M2M100ForConditionalGeneration": ("bart_family", "M2M100ForConditionalGeneration"),
    "PegasusForConditionalGeneration": ("bart_family", "PegasusForConditionalGeneration"),
    "T5ForConditionalGeneration": ("t5", "T5ForConditionalGeneration"),
    "MT5ForConditionalGeneration": ("t5", "T5ForConditionalGeneration"),
    "WhisperForConditionalGeneration": ("whisper", "WhisperForConditionalGeneration"),
}
