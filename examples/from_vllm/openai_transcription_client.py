"""vLLM's examples/online_serving/openai_transcription_client.py against ``tandem serve``: one
transcription with the ``openai`` client, then one streamed: with ``AsyncOpenAI`` when the
served model's name has "openai" in it (read from each chunk's ``choices``), else through
a plain HTTP request (needs ``requests``), each with vLLM's extra sampling fields.

Changed from vLLM's: the import (``vllm.assets`` -> ``tandem.assets``) and one flag,
``--base-url``, defaulting to vLLM's ``http://localhost:8000/v1``. Serve the demo Whisper
(under vLLM's model name for the ``AsyncOpenAI`` stream), then run this script:

    tandem serve "$(tandem demo --whisper --path)" --served-model-name openai/whisper-large-v3
    python examples/from_vllm/openai_transcription_client.py

``AudioAsset`` gives vLLM's recordings when they are in the assets folder, else the demo's
tone speech (docs/from_vllm.md). Needs the ``openai`` package.
"""

import argparse
import asyncio

from openai import AsyncOpenAI, OpenAI

from tandem.assets.audio import AudioAsset


def sync_openai(audio_path: str, client: OpenAI, model: str):
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
        print("transcription result [sync]:", transcription.text)
    return transcription.text


async def stream_openai_response(audio_path: str, client: AsyncOpenAI, model: str):
    """One transcription, streamed through the ``openai`` client."""
    print("\ntranscription result [stream]:", end=" ")
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


def stream_api_response(audio_path: str, model: str, openai_api_base: str):
    """One transcription, streamed through a plain HTTP request: each line's JSON, until a
    chunk with a finish reason."""
    import json
    import os

    import requests

    api_url = f"{openai_api_base}/audio/transcriptions"
    headers = {"User-Agent": "Transcription-Client"}
    pieces = []
    with open(audio_path, "rb") as f:
        files = {"file": (os.path.basename(audio_path), f)}
        data = {"stream": "true", "model": model, "language": "en", "response_format": "json"}
        print("\ntranscription result [stream]:", end=" ")
        response = requests.post(api_url, headers=headers, files=files, data=data, stream=True)
        for chunk in response.iter_lines(chunk_size=8192, decode_unicode=False, delimiter=b"\n"):
            if chunk:
                data = json.loads(chunk[len("data: "):].decode("utf-8"))
                data = data["choices"][0]
                delta = data["delta"]["content"]
                print(delta, end="", flush=True)
                pieces.append(delta)
                finish_reason = data.get("finish_reason")
                if finish_reason is not None:
                    print(f"\n[Stream finished reason: {finish_reason}]")
                    break
    return "".join(pieces)


def main(args):
    mary_had_lamb = str(AudioAsset("mary_had_lamb").get_local_path())
    winning_call = str(AudioAsset("winning_call").get_local_path())
    openai_api_key = "EMPTY"
    openai_api_base = args.base_url
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
    model = client.models.list().data[0].id
    print(f"Using model: {model}")
    plain = sync_openai(args.audio_path if args.audio_path else mary_had_lamb, client, model)
    if "openai" in model:
        client = AsyncOpenAI(api_key=openai_api_key, base_url=openai_api_base)
        streamed = asyncio.run(stream_openai_response(args.audio_path if args.audio_path else winning_call,
                                                      client, model))
    else:
        streamed = stream_api_response(args.audio_path if args.audio_path else winning_call, model, openai_api_base)
    return plain, streamed


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="OpenAI transcription client for tandem serve")
    parser.add_argument("--audio_path", type=str, default=None, help="The path to the audio file to transcribe.")
    parser.add_argument("--base-url", default="http://localhost:8000/v1", help="the server's API root")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
