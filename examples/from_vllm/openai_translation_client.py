"""vLLM's examples/online_serving/openai_translation_client.py against ``tandem serve``: one
translation with the ``openai`` client, then one streamed through a plain HTTP request (the
``openai`` client does not stream translations), read line by line as vLLM's client reads
it: ``choices[0].delta.content`` of every event up to ``[DONE]``.

Changed from vLLM's: the import (``vllm.assets`` -> ``tandem.assets``) and one flag,
``--base-url``, defaulting to vLLM's ``http://localhost:8000/v1``. Serve the demo Whisper
under vLLM's model name, then run this script:

    tandem serve "$(tandem demo --whisper --path)" --served-model-name openai/whisper-large-v3
    python examples/from_vllm/openai_translation_client.py

``AudioAsset("azacinto_foscolo")`` is vLLM's Italian recording when it is in the assets
folder, else the demo's tone speech (docs/from_vllm.md). vLLM's ``language="it"`` (the
audio's language) is accepted and not used: tandem detects a translation's source language
from the audio. Needs the ``openai`` package (and ``httpx``, which it brings).
"""

import argparse
import asyncio
import json

import httpx
from openai import OpenAI

from tandem.assets.audio import AudioAsset


def sync_openai(audio_path: str, client: OpenAI):
    with open(audio_path, "rb") as f:
        translation = client.audio.translations.create(
            file=f,
            model="openai/whisper-large-v3",
            response_format="json",
            temperature=0.0,
            # vLLM's fields, beyond OpenAI's API
            extra_body=dict(language="it", seed=4419, repetition_penalty=1.3),
        )
        print("translation result:", translation.text)
    return translation.text


async def stream_openai_response(audio_path: str, base_url: str, api_key: str):
    data = {"language": "it", "stream": True, "model": "openai/whisper-large-v3"}
    url = base_url + "/audio/translations"
    headers = {"Authorization": f"Bearer {api_key}"}
    print("translation result:", end=" ")
    pieces = []
    async with httpx.AsyncClient() as client:
        with open(audio_path, "rb") as f:
            async with client.stream("POST", url, files={"file": f}, data=data, headers=headers) as response:
                async for line in response.aiter_lines():
                    # each event is a line "data: <JSON>"; the last is "data: [DONE]"
                    if line:
                        if line.startswith("data: "):
                            line = line[len("data: "):]
                        if line.strip() == "[DONE]":
                            break
                        chunk = json.loads(line)
                        content = chunk["choices"][0].get("delta", {}).get("content")
                        print(content, end="")
                        pieces.append(content)
    print()
    return "".join(pieces)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="OpenAI-compatible translation client for tandem serve")
    parser.add_argument("--base-url", default="http://localhost:8000/v1", help="the server's API root")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    foscolo = str(AudioAsset("azacinto_foscolo").get_local_path())
    openai_api_key = "EMPTY"
    openai_api_base = args.base_url
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
    plain = sync_openai(foscolo, client)
    streamed = asyncio.run(stream_openai_response(foscolo, openai_api_base, openai_api_key))
    return plain, streamed


if __name__ == "__main__":
    main()
