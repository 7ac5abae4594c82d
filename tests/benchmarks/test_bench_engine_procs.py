"""benchmarks/engine_procs: each engine in a process of its own, loaded once and
called across rounds; a child that fails to load, raises or dies is reported as
that engine failing while the others go on; and benchmarks/throughput.py run
that way gives the outputs HF gives, from different processes."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import engine_procs  # noqa: E402
import throughput  # noqa: E402


def test_a_child_holds_its_object_across_calls_with_its_thread_env():
    proc = engine_procs.start("counter", "collections:Counter", "abca", env=engine_procs.thread_env(3))
    try:
        assert proc.pid != os.getpid()
        assert proc.call("most_common", 1) == [("a", 2)]
        proc.call("update", "bb")  # the same object, kept between calls
        assert proc.call("most_common", 1) == [("b", 3)]
        with pytest.raises(engine_procs.EngineFailed, match="counter: AttributeError"):
            proc.call("no_such_method")
        assert proc.call("total") == 6  # a call that raised leaves the child serving
    finally:
        proc.close()
    assert proc.proc.returncode == 0
    env = engine_procs.start("env", "os:getenv", "OMP_NUM_THREADS", env=engine_procs.thread_env(3))
    try:
        assert env.call("__str__") == "3"  # set before the child imported anything
    finally:
        env.close()


def test_a_child_that_fails_to_load_or_dies_raises_engine_failed_naming_it():
    with pytest.raises(engine_procs.EngineFailed, match=r"bad: JSONDecodeError"):
        engine_procs.start("bad", "json:loads", "{")
    with pytest.raises(engine_procs.EngineFailed, match=r"gone: process \d+ died \(exit code 3\)"):
        engine_procs.start("gone", "os:_exit", 3)
    with pytest.raises(engine_procs.EngineFailed, match="nothing: .*No module named 'no_such_module'"):
        engine_procs.start("nothing", "no_such_module:x")


class _Fake:
    """A loaded engine's handle whose ``timed`` returns the right number of tokens,
    or raises EngineFailed as a dead child's handle does."""

    def __init__(self, name, dies=False):
        self.name, self.dies, self.calls = name, dies, 0

    def call(self, method, runner, kwargs, requests):
        self.calls += 1
        if self.dies:
            raise engine_procs.EngineFailed(f"{self.name}: process 1 died (killed by signal 9)")
        out = [[7] * requests.workload.new_tokens for _ in requests.encoder_ids]
        return (out, [0.01] * len(out)) if requests.workload.one_at_a_time else (out, 0.05)


def test_an_engine_that_dies_gets_a_failed_row_and_the_others_still_run():
    from transformers import BartConfig

    config = BartConfig(**throughput.MODEL_SIZES["tiny"].config)
    args = throughput.parse_args(["--engines", "tandem,hf", "--repeat", "2", "--threads", "1"])
    workloads = [throughput.make_requests(throughput.WORKLOADS[n], config, 2, 0)
                 for n in ("latency", "translation")]
    dead = _Fake("hf", dies=True)
    engines = {"tandem": (_Fake("tandem"), 1.0, {"labels": ["default"], "pid": 11}),
               "hf": (dead, 1.0, {"labels": [""], "pid": 12})}
    failed = {"ct2": "ct2: RuntimeError: no compute type"}  # failed to load: a row per workload too
    results = throughput.run_benchmarks(engines, workloads, config, args, failed)
    rows = {(r.workload, r.engine): r for r in results}
    assert set(rows) == {(w, e) for w in ("latency", "translation") for e in ("tandem", "hf", "ct2")}
    assert dead.calls == 1  # not asked again once it died
    assert rows[("translation", "tandem")].runs == [0.05, 0.05] and not rows[("translation", "tandem")].error
    assert "killed by signal 9" in rows[("latency", "hf")].error
    assert rows[("translation", "ct2")].error == "ct2: RuntimeError: no compute type"
    throughput.compare_with_hf(results)  # no HF figures to compare with: no ratios, no crash
    assert rows[("translation", "tandem")].ratio_vs_hf is None
    table = throughput.format_table(results, 100.0)
    latency = throughput.format_latency_table(results)
    assert "FAILED: hf: process 1 died (killed by signal 9)" in table
    assert "FAILED: ct2: RuntimeError: no compute type" in latency
    assert "translation" not in latency and "latency " not in table


@pytest.mark.slow  # 20-60 s on 2 shared cores: two children each import torch and load an engine
def test_tandem_and_hf_in_their_own_processes_give_hfs_outputs(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    model_dir = str(tmp_path / "bart")
    throughput.make_model("tiny", model_dir, seed=0)
    args = throughput.parse_args(["--model", model_dir, "--engines", "tandem,hf", "--repeat", "1",
                                  "--threads", "1", "--hf-batch-size", "2"])
    config = throughput.load_config(model_dir)
    workloads = [throughput.make_requests(throughput.WORKLOADS[n], config, 2, 0)
                 for n in ("latency", "translation")]
    engines, failed = throughput.load_engines(["tandem", "hf"], model_dir, args)
    try:
        assert failed == {}
        results = throughput.run_benchmarks(engines, workloads, config, args, failed)
    finally:
        for handle, _, _ in engines.values():
            handle.close()
    pids = {r.engine: r.pid for r in results}
    assert len({pids["tandem"], pids["hf"], os.getpid()}) == 3

    # The oracle: HF here, one request at a time (no padding), greedy, fixed length.
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    rows = {(r.workload, r.engine): r for r in results}
    for requests in workloads:
        n = requests.workload.new_tokens
        expected = []
        with torch.inference_mode():
            for ids in requests.encoder_ids:
                seq = model.generate(input_ids=torch.tensor([ids]),
                                     decoder_input_ids=torch.tensor([requests.decoder_prompt]),
                                     max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1)
                expected.append(seq[0, len(requests.decoder_prompt):].tolist())
        for engine in ("tandem", "hf"):
            assert rows[(requests.workload.name, engine)].outputs == expected, (requests.workload.name, engine)
