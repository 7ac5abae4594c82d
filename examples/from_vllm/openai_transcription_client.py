"""Transcription through ``tandem serve`` with the ``openai`` client.

The same calls as vLLM's examples/online_serving/openai_transcription_client.py: one
transcription with ``OpenAI``, then one streamed with ``AsyncOpenAI``, each with vLLM's
extra sampling fields in ``extra_body``, the streamed text read from each chunk's
``choices`` as vLLM's client reads it. What differs: the server (``tandem serve`` in
place of ``vllm serve``) and the audio (the demo Whisper's own clips, in place of
vLLM's ``AudioAsset`` downloads).

Start a server on the shipped demo Whisper, then run this script:

    tandem serve "$(tandem demo --whisper --path)" --port 8000
    python examples/from_vllm/openai_transcription_client.py --base-url http://localhost:8000/v1

Needs the ``openai`` package.
"""

import argparse
import asyncio
from pathlib import Path

from openai import AsyncOpenAI, OpenAI

from tandem.demo_whisper import PATH as DEMO_WHISPER


def sync_openai(audio_path, model, client):
    """One transcription, answered whole."""
    with open(audio_path, "rb") as f:
        transcription = client.audio.transcriptions.create(
            file=f,
            model=model,
            language="en",
            response_format="json",
            temperature=0.0,
            # vLLM's sampling fields, beyond OpenAI's API
            extra_body=dict(seed=4419, repetition_penalty=1.3),
        )
    print("transcription result:", transcription.text)
    return transcription.text


async def stream_openai_response(audio_path, model, client):
    """One transcription, streamed: the text arrives window by window."""
    print("\ntranscription result:", end=" ")
    pieces = []
    with open(audio_path, "rb") as f:
        transcription = await client.audio.transcriptions.create(
            file=f,
            model=model,
            language="en",
            response_format="json",
            temperature=0.0,
            extra_body=dict(seed=420, top_p=0.6),
            stream=True,
        )
        async for chunk in transcription:
            if chunk.choices:
                content = chunk.choices[0].get("delta", {}).get("content")
                print(content, end="", flush=True)
                pieces.append(content)
    print()
    return "".join(pieces)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="OpenAI-compatible transcription client for tandem serve.")
    parser.add_argument("--base-url", default="http://localhost:8000/v1",
                        help="the server's API root (default: http://localhost:8000/v1)")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if it has one")
    parser.add_argument("--model", default=None,
                        help="the served model's name; by default the first one /v1/models lists")
    return parser.parse_args(argv)


def resolve_model(client, user_model):
    if user_model:
        return user_model
    try:
        models = client.models.list()
        if not getattr(models, "data", None):
            raise RuntimeError("/v1/models listed no model")
        model = models.data[0].id
    except Exception as exc:
        raise RuntimeError("could not read the served model from /v1/models; give --model") from exc
    print(f"Using the model /v1/models lists: {model}")
    return model


def main(argv=None):
    args = parse_args(argv)
    three_one_four = str(Path(DEMO_WHISPER) / "three_one_four.wav")
    hello_world = str(Path(DEMO_WHISPER) / "hello_world.wav")

    client = OpenAI(api_key=args.api_key, base_url=args.base_url)
    model = resolve_model(client, args.model)
    plain = sync_openai(three_one_four, model, client)
    async_client = AsyncOpenAI(api_key=args.api_key, base_url=args.base_url)
    streamed = asyncio.run(stream_openai_response(hello_world, model, async_client))
    return plain, streamed


if __name__ == "__main__":
    main()
