"""The Ray Serve deployment of the OpenAI server answers the official openai client
as ``LLM.generate`` would (plain and streamed completions), refuses chat with the
server's own message, and leaves no replica behind once deleted."""

import socket
import time

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from tandem import LLM, SamplingParams  # noqa: E402

ENGINE = dict(dtype="float32", device="cpu", attention_backend="torch_sdpa")
KEY = "serve-key"
PROMPTS = ["the rain in spain", "red blue green small", "a cat sat"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replicas(ray) -> list:
    """The deployment's replica actors that are alive, from the GCS (no dashboard needed)."""
    from ray._private.state import actors

    return [a for a in actors().values()
            if "tandem" in a.get("Name", "") and "Replica" in a.get("ActorClassName", "") and a["State"] != "DEAD"]


def _when_up(client, seconds: float = 180):
    """``/v1/models``, once the app answers (its replica's engine is up)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return client.models.list()
        except (openai.APIConnectionError, openai.NotFoundError, openai.InternalServerError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_serve_deployment_answers_the_openai_client(ray_local, bart_dir):
    from ray import serve

    from tandem.integrations.ray.serve import build_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        # As `serve run tandem.integrations.ray.serve:build_app model=... key=value` passes them: strings.
        app = build_app({"model": str(bart_dir), "served_model_name": "bart", "api_key": KEY, "dtype": "float32",
                         "device": "cpu", "attention_backend": "torch_sdpa", "max_num_seqs": "8"})
        serve.run(app, name="tandem", route_prefix="/", blocking=False)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in _when_up(client).data] == ["bart"]

        ref = LLM(str(bart_dir), **ENGINE).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8),
                                                   use_tqdm=False)
        got = client.completions.create(model="bart", prompt=PROMPTS, max_tokens=8, temperature=0.0)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in ref]
        assert got.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)

        stream = client.completions.create(model="bart", prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == ref[0].outputs[0].text

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model="bart", prompt="the rain", max_tokens=-1)
        # An encoder/decoder model takes no chat messages: the server's 404 says so.
        with pytest.raises(openai.NotFoundError, match="takes no chat messages"):
            client.chat.completions.create(model="bart", messages=[{"role": "user", "content": "hi"}])
        assert len(_replicas(ray_local)) == 1
    finally:
        started = time.monotonic()
        serve.shutdown()
        print(f"serve.shutdown took {time.monotonic() - started:.1f} s")
    deadline = time.monotonic() + 30
    while _replicas(ray_local) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _replicas(ray_local) == []


def test_build_app_names_a_bad_key(bart_dir):
    from tandem.integrations.ray.serve import build_app

    with pytest.raises(ValueError, match=r"unknown key 'max_num_seq'; did you mean max_num_seqs"):
        build_app({"model": str(bart_dir), "max_num_seq": "8"})
    with pytest.raises(ValueError, match=r"--max-num-seqs: invalid int value: 'eight'"):
        build_app({"model": str(bart_dir), "max_num_seqs": "eight"})
    with pytest.raises(ValueError, match="needs model="):
        build_app({"dtype": "float32"})


def test_build_app_reads_each_key_as_its_flag(bart_dir):
    """``serve run``'s strings become the engine's, the server's and the deployment's typed
    values, as ``tandem serve``'s flags of the same names parse them."""
    from tandem.integrations.ray.serve import build_app

    app = build_app({"model": str(bart_dir), "max-num-seqs": "8", "trust_remote_code": "false", "swap_space": "0.5",
                     "num_replicas": "2", "num_gpus": "0.5", "api_key": "k", "max_audio_seconds": "0",
                     "allowed_local_media_path": "/srv/media"})
    deployment = app._bound_deployment
    model, engine, server = deployment.init_args
    assert model == str(bart_dir)
    assert engine["max_num_seqs"] == 8 and engine["swap_space"] == 0.5 and engine["trust_remote_code"] is False
    assert server == {"api_key": "k", "max_audio_seconds": None,  # 0: no limit, as the flag
                      "allowed_local_media_path": "/srv/media"}
    assert deployment.num_replicas == 2 and deployment.ray_actor_options["num_gpus"] == 0.5


def test_build_app_passes_the_lora_modules_to_each_replica(bart_dir, tmp_path):
    """``lora_modules`` reaches the replica's server as ``tandem serve --lora-modules`` gives
    it (so the adapters are served by name there), checked before any replica starts."""
    from lora_adapters import make_adapter
    from tandem.integrations.ray.serve import build_app

    a, b = (make_adapter(bart_dir, tmp_path / name, ["q_proj"], seed=i) for i, name in enumerate("ab"))
    app = build_app({"model": str(bart_dir), "enable_lora": "true", "lora_modules": f"a={a} b={b}",
                     "lora_allowed_dir": str(tmp_path)})
    _, engine, server = app._bound_deployment.init_args
    assert engine["enable_lora"] is True
    assert server == {"lora_modules": [("a", str(a)), ("b", str(b))], "lora_allowed_dir": str(tmp_path)}
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        build_app({"model": str(bart_dir), "lora_modules": f"a={a}"})
    with pytest.raises(ValueError, match="is given twice"):
        build_app({"model": str(bart_dir), "enable_lora": "true", "lora_modules": f"a={a} a={b}"})


def test_tensor_parallel_replica_reserves_its_ranks(ray_local, bart_dir):
    """A replica whose engine runs TP=2 on the Ray executor: the deployment reserves one
    CPU bundle per rank (the replica itself in bundle 0, reserving nothing), the ranks
    fill them, and the completions equal one process's; deleting the app frees both CPUs."""
    from ray import serve

    from tandem.integrations.ray.serve import deployment

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = deployment(str(bart_dir), served_model_name="bart", tensor_parallel_size=2,
                         distributed_executor_backend="ray", **ENGINE)
        serve.run(app, name="tandem-tp", route_prefix="/", blocking=False)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        _when_up(client)
        # Both ranks hold their bundle's CPU: had the executor made a group of its own beside the
        # replica's, it could not have been placed on 2 CPUs and start-up would have failed.
        assert ray_local.available_resources().get("CPU", 0) == 0
        ref = LLM(str(bart_dir), **ENGINE).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8),
                                                   use_tqdm=False)
        got = client.completions.create(model="bart", prompt=PROMPTS, max_tokens=8, temperature=0.0)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in ref]
    finally:
        serve.shutdown()
    deadline = time.monotonic() + 30
    while ray_local.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("CPU", 0) == 2
