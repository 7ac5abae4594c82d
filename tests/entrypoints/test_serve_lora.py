"""LoRA adapters on the server (``tandem/entrypoints/openai/lora_modules.py``): the
request's ``model`` picks the adapter on completions and the audio endpoints,
``/v1/models`` lists base and adapters (``parent``), an unknown name is a 404, and
vLLM's load / unload endpoints load only from the directory the operator allowed.

In-process tests read what reached the worker (each ``ScheduledGroup.lora_request``)
through a spy on the executor; the real server on 127.0.0.1 is driven with the
official ``openai`` client, its outputs checked against the offline engine run with
the same adapters."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from lora_adapters import make_peft_adapter
from tandem import LLM, AsyncLLM, LoRARequest, SamplingParams
from tandem.demo_whisper import PATH as WHISPER
from tandem.entrypoints.openai.api_server import build_app
from test_serve import _start, _stop

KEY = "sk-lora"
WAIT = 60.0  # a tiny model on 2 busy cores answers in well under a second; generous
PROMPT = {"prompt_token_ids": [0, 17, 5, 9, 2]}


@pytest.fixture(scope="module")
def adapter_root(bart_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_root")
    for i, name in enumerate(("alpha", "beta", "gamma"), start=1):
        make_peft_adapter(bart_dir, root / name, seed=i)
    return root


@pytest.fixture(scope="module")
def engine(bart_dir):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2)
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


def spy(engine) -> dict[str, object]:
    """request id -> the lora_request its ScheduledGroups carried."""
    seen: dict[str, object] = {}
    executor = engine.engine.executor
    real = getattr(executor, "_lora_spy_real", executor.execute_model)
    executor._lora_spy_real = real

    def execute_model(out, *args, **kwargs):
        for sg in out.scheduled:
            seen[sg.request_id] = sg.lora_request
        return real(out, *args, **kwargs)

    executor.execute_model = execute_model
    return seen


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT)


def _app(engine, adapter_root, **kw):
    return build_app(engine, served_model_name="base", lora_modules=[("alpha", str(adapter_root / "alpha")),
                                                                     ("beta", str(adapter_root / "beta"))], **kw)


def test_models_lists_the_base_and_each_adapter_with_its_parent(engine, adapter_root):
    async def main():
        async with _client(_app(engine, adapter_root)) as c:
            return (await c.get("/v1/models")).json()["data"]

    data = asyncio.run(main())
    assert [(m["id"], m["parent"]) for m in data] == [("base", None), ("alpha", "base"), ("beta", "base")]
    assert data[1]["root"] == str(adapter_root / "alpha")


def test_the_model_field_picks_the_adapter_and_an_unknown_one_is_a_404(engine, adapter_root):
    seen = spy(engine)

    async def main():
        async with _client(_app(engine, adapter_root)) as c:
            out = {}
            for model in ("alpha", "beta", "base", None):
                body = {"prompt": [PROMPT, PROMPT], "max_tokens": 3, "temperature": 0}
                if model is not None:
                    body["model"] = model
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["model"] == (model or "base")
                out[model] = r.json()["id"]
            streamed = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "model": "beta",
                                                              "stream": True})
            assert streamed.status_code == 200 and '"model": "beta"' in streamed.text.replace('":"', '": "')
            missing = await c.post("/v1/completions", json={"prompt": PROMPT, "model": "gamma"})
            return out, missing

    ids, missing = asyncio.run(main())
    by_model = {}
    for rid, lora in seen.items():
        for model, base_id in ids.items():
            if rid.startswith(base_id):
                by_model.setdefault(model, set()).add(lora)
    assert {m: {getattr(x, "lora_name", None) for x in v} for m, v in by_model.items()} == {
        "alpha": {"alpha"}, "beta": {"beta"}, "base": {None}, None: {None}}
    assert {x.lora_name for x in seen.values() if x is not None} == {"alpha", "beta"}  # the stream's too
    assert missing.status_code == 404
    err = missing.json()["error"]
    assert err["param"] == "model" and "'gamma'" in err["message"] and "'alpha'" in err["message"]


def test_runtime_loading_is_off_without_an_allowed_dir(engine, adapter_root):
    async def main():
        async with _client(_app(engine, adapter_root)) as c:
            return await c.post("/v1/load_lora_adapter", json={"lora_name": "g",
                                                               "lora_path": str(adapter_root / "gamma")})

    r = asyncio.run(main())
    assert r.status_code == 403 and "--lora-allowed-dir" in r.json()["error"]["message"]


def test_load_and_unload_inside_the_allowed_dir_only(engine, adapter_root, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    os.symlink(adapter_root / "gamma", allowed / "gamma")  # inside as written, outside once resolved
    make_peft_adapter_dir = allowed / "delta"
    import shutil

    shutil.copytree(adapter_root / "gamma", make_peft_adapter_dir)
    (allowed / "empty").mkdir()
    seen = spy(engine)

    async def main():
        app = _app(engine, adapter_root, lora_allowed_dir=os.path.realpath(allowed))
        async with _client(app) as c:
            load = lambda name, path: c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            refused = [await load("g", p) for p in (str(adapter_root / "gamma"), str(allowed / "gamma"),
                                                    "../lora_root/gamma", "/etc", "/no/such/dir")]
            empty = await load("e", "empty")
            ok = await load("delta", "delta")
            again = await load("delta", "delta")
            names = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            gen = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "model": "delta"})
            unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "delta"})
            after = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "model": "delta"})
            unload_again = await c.post("/v1/unload_lora_adapter", json={"lora_name": "delta"})
            return refused, empty, ok, again, names, gen, unload, after, unload_again

    refused, empty, ok, again, names, gen, unload, after, unload_again = asyncio.run(main())
    # One answer for every path outside the allowed dir, whether it exists or not.
    assert {r.status_code for r in refused} == {403}
    assert len({r.json()["error"]["message"] for r in refused}) == 1
    assert empty.status_code == 400 and "adapter_config.json" in empty.json()["error"]["message"]
    assert ok.status_code == 200 and "delta" in ok.text
    assert again.status_code == 400
    assert names == ["base", "alpha", "beta", "delta"]
    assert gen.status_code == 200
    loaded = seen[gen.json()["id"]]
    assert loaded.lora_name == "delta" and loaded.lora_path == os.path.realpath(allowed / "delta")
    assert unload.status_code == 200 and after.status_code == 404 and unload_again.status_code == 404


def test_without_enable_lora_no_lora_routes_and_no_modules(bart_dir, adapter_root):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    try:
        with pytest.raises(ValueError, match="--enable-lora"):
            build_app(engine, served_model_name="base", lora_modules=[("alpha", str(adapter_root / "alpha"))])

        async def main():
            async with _client(build_app(engine, served_model_name="base")) as c:
                return await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})

        assert asyncio.run(main()).status_code == 404
    finally:
        asyncio.run(engine.shutdown(timeout=WAIT))


def test_an_adapter_above_max_lora_rank_is_refused_at_start(bart_dir, tmp_path):
    big = make_peft_adapter(bart_dir, tmp_path / "big", r=32)
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=16)
    try:
        with pytest.raises(ValueError, match="r=32 is above max_lora_rank=16"):
            build_app(engine, served_model_name="base", lora_modules=[("big", str(big))])
    finally:
        asyncio.run(engine.shutdown(timeout=WAIT))


def test_the_audio_endpoints_pick_the_adapter_by_model(tmp_path):
    adapter = make_peft_adapter(WHISPER, tmp_path / "accent", seed=5)
    engine = AsyncLLM(model=str(WHISPER), dtype="float32", device="cpu", enable_lora=True)
    seen = spy(engine)
    try:
        async def main():
            app = build_app(engine, served_model_name="w", lora_modules=[("accent", str(adapter))])
            async with _client(app) as c:
                out = []
                for model in ("accent", "w", "nope"):
                    with open(WHISPER / "hello_world.wav", "rb") as f:
                        out.append(await c.post("/v1/audio/transcriptions", files={"file": ("a.wav", f.read())},
                                                data={"model": model}))
                return out

        accent, base, nope = asyncio.run(main())
    finally:
        asyncio.run(engine.shutdown(timeout=WAIT))
    assert accent.status_code == 200 and base.status_code == 200, (accent.text, base.text)
    assert nope.status_code == 404
    assert {getattr(x, "lora_name", None) for x in seen.values()} == {"accent", None}


@pytest.mark.slow
def test_real_server_serves_two_adapters_and_the_base_through_openai(bart_dir, adapter_root):
    import openai
    from openai import OpenAI

    proc, url = _start(bart_dir, "--api-key", KEY, "--served-model-name", "base", "--enable-lora",
                       "--max-loras", "2", "--lora-modules", f"alpha={adapter_root / 'alpha'}",
                       '{"name": "beta", "path": "%s"}' % (adapter_root / "beta"))
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=WAIT, max_retries=0)
        models = client.models.list().data
        assert [m.id for m in models] == ["base", "alpha", "beta"]
        assert [getattr(m, "parent", None) for m in models] == [None, "base", "base"]
        served = {m: client.completions.create(model=m, prompt="the rain in spain", max_tokens=6,
                                               temperature=0).choices[0].text for m in ("base", "alpha", "beta")}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gamma", prompt="x", max_tokens=2)
        # The runtime endpoints sit behind the key like every /v1/ route.
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": "/tmp"}, timeout=WAIT)
        assert r.status_code == 401
    finally:
        assert _stop(proc) == 0
    llm = LLM(str(bart_dir), dtype="float32", enable_lora=True, max_loras=2)
    loras = {"base": None, "alpha": LoRARequest("alpha", 1, str(adapter_root / "alpha")),
             "beta": LoRARequest("beta", 2, str(adapter_root / "beta"))}
    offline = {m: llm.generate("the rain in spain", SamplingParams(max_tokens=6, temperature=0), lora_request=lora,
                               use_tqdm=False)[0].outputs[0].text for m, lora in loras.items()}
    assert served == offline
    assert len(set(served.values())) == 3  # each adapter's output is its own (tandem/lora's math)
