"""vLLM's examples/offline_inference/whisper_multilora_inference.py on tandem: Whisper with
LoRA adapters, the base model first, then each adapter whose folder exists.

Changed from vLLM's: the imports (``vllm`` -> ``tandem``) and the model (the demo Whisper
shipped in the package, in place of openai/whisper-large-v3-turbo). The engine arguments
(``enable_lora=True``, ``max_loras=4``, ``max_lora_rank=64``, ``max_model_len=448``,
``dtype="half"``, ``gpu_memory_utilization=0.8``, ``trust_remote_code=True``), the prompt
(``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``), ``max_tokens=200`` and the
placeholder adapter paths are vLLM's: put PEFT LoRA adapters of your Whisper there.
"""

import os
from pathlib import Path

import tandem
from tandem import LLM, SamplingParams
from tandem.assets.audio import AudioAsset
from tandem.lora import LoRARequest

MODEL = str(Path(tandem.__file__).parent / "demo_whisper")  # vLLM's: "openai/whisper-large-v3-turbo"


def create_whisper_prompt(language: str = "en") -> dict:
    """A transcription prompt for Whisper: the full decoder prompt and the audio.

    ``language``: an ISO 639-1 code ("en", "ko", "ja", ...)."""
    audio_data = AudioAsset("mary_had_lamb").audio_and_sample_rate
    # <|startoftranscript|><|language|><|task|><|notimestamps|>
    prompt = f"<|startoftranscript|><|{language}|><|transcribe|><|notimestamps|>"
    return {"prompt": prompt, "multi_modal_data": {"audio": audio_data}}


def run_base_model_inference(llm: LLM, sampling_params: SamplingParams) -> list:
    """The base Whisper, no adapter."""
    print("\n" + "=" * 60)
    print("Running inference with BASE MODEL (no LoRA)")
    print("=" * 60)
    outputs = llm.generate([create_whisper_prompt(language="en")], sampling_params=sampling_params)
    for output in outputs:
        print(f"Transcription: {output.outputs[0].text}")
    return outputs


def run_lora_inference(llm: LLM, sampling_params: SamplingParams, lora_path: str, lora_name: str,
                       lora_id: int) -> list:
    """One adapter: its name, a unique integer id and its folder."""
    print("\n" + "=" * 60)
    print(f"Running inference with LoRA: {lora_name}")
    print("=" * 60)
    lora_request = LoRARequest(lora_name, lora_id, lora_path)
    outputs = llm.generate([create_whisper_prompt(language="en")], sampling_params=sampling_params,
                           lora_request=lora_request)
    for output in outputs:
        print(f"Transcription: {output.outputs[0].text}")
    return outputs


def main(lora_paths=None):
    print("Initializing Whisper model with Multi-LoRA support...")
    llm = LLM(
        model=MODEL,
        enable_lora=True,
        max_loras=4,  # adapters held at once
        max_lora_rank=64,  # the largest rank an adapter may have
        max_model_len=448,  # Whisper's decoder positions
        dtype="half",
        gpu_memory_utilization=0.8,
        trust_remote_code=True,
    )
    sampling_params = SamplingParams(temperature=0, max_tokens=200)
    results = {"base": run_base_model_inference(llm, sampling_params)}
    # placeholders: replace them with your adapters' folders
    if lora_paths is None:
        lora_paths = [
            ("lora_adapter_1", "/path/to/your/lora_adapter_1"),
            ("lora_adapter_2", "/path/to/your/lora_adapter_2"),
        ]
    for lora_id, (lora_name, lora_path) in enumerate(lora_paths, start=1):
        if os.path.exists(lora_path):
            results[lora_name] = run_lora_inference(llm, sampling_params, lora_path, lora_name, lora_id)
        else:
            print(f"\nSkipping {lora_name}: path does not exist ({lora_path})")
            print("To use LoRA adapters, update lora_paths with valid paths.")
    print("\n" + "=" * 60)
    print("Multi-LoRA inference complete!")
    print("=" * 60)
    return results


if __name__ == "__main__":
    main()
