"""Every way to prompt a text encoder/decoder model, written against vLLM's API.

The same calls as vLLM's examples/offline_inference/encoder_decoder.py, with the import
(``vllm`` -> ``tandem``) and the model (the shipped demo BART) changed, and the prompts'
sentences: the demo BART is a toy that reverses sentences of its small lowercase vocabulary,
so each of vLLM's prompt forms here holds a sentence of its words (``max_tokens=20`` and the
other sampling arguments are vLLM's).
"""

from pathlib import Path

import tandem
from tandem import LLM, SamplingParams
from tandem.inputs import ExplicitEncoderDecoderPrompt, TextPrompt, TokensPrompt, zip_enc_dec_prompts

MODEL = str(Path(tandem.__file__).parent / "demo_model")  # vLLM's example: facebook/bart-large-cnn


def create_prompts(tokenizer):
    # Singleton prompts: each is the encoder's input, the decoder starts from the model's default.
    text_prompt_raw = "the cat sat on the mat"
    text_prompt = TextPrompt(prompt="the dog ran in the park")
    tokens_prompt = TokensPrompt(prompt_token_ids=tokenizer.encode(prompt="a bird sang in the tree"))
    # Explicit pairs: any singleton in either slot.
    enc_dec_prompt1 = ExplicitEncoderDecoderPrompt(encoder_prompt=text_prompt_raw, decoder_prompt=tokens_prompt)
    enc_dec_prompt2 = ExplicitEncoderDecoderPrompt(encoder_prompt=text_prompt, decoder_prompt=text_prompt_raw)
    enc_dec_prompt3 = ExplicitEncoderDecoderPrompt(encoder_prompt=tokens_prompt, decoder_prompt=text_prompt)
    zipped = zip_enc_dec_prompts(["the sun is hot", "the moon is bright"], ["the sun", "the moon"])
    return [text_prompt_raw, text_prompt, tokens_prompt, enc_dec_prompt1, enc_dec_prompt2, enc_dec_prompt3] + zipped


def create_sampling_params():
    return SamplingParams(temperature=0, top_p=1.0, min_tokens=0, max_tokens=20)


def print_outputs(outputs):
    print("-" * 50)
    for i, output in enumerate(outputs):
        print(f"Output {i + 1}:")
        print(f"Encoder prompt: {output.encoder_prompt!r}")
        print(f"Decoder prompt: {output.prompt!r}")
        print(f"Generated text: {output.outputs[0].text!r}")
        print("-" * 50)


def main():
    llm = LLM(model=MODEL, dtype="float")
    tokenizer = llm.llm_engine.get_tokenizer_group()
    prompts = create_prompts(tokenizer)
    outputs = llm.generate(prompts, create_sampling_params())
    print_outputs(outputs)
    return prompts, outputs


if __name__ == "__main__":
    main()
