"""One adapter can never poison, stall or kill the engine (issue 50): an adapter whose
values are finite but overflow float32 (``lora_A = 1e38``) beside a good one.

- The layer: each row's update is its own adapter's merged weight (float64 oracle,
  ``W + s B A`` per row), finite, whatever another slot holds; the overflowing slot is
  reported for its rows alone.
- The engine: such an adapter is refused when it is mapped, naming the module and
  the bound; with that check switched off, the step's guard fails its requests alone.
  Either way the other requests are served as if alone and no step counts as failed,
  however many steps it takes part in (three failed steps in a row kill the engine)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import make_bart
from lora_adapters import make_adapter
from tandem import LLM, LoRARequest, SamplingParams
from tandem.core.layers import ColumnParallelLinear, QKVParallelLinear
from tandem.lora.layers import DECODER, LinearLoRA, LoRAStep
from tandem.lora.mapping import shards_of

f64 = torch.float64
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [{"prompt_token_ids": [5, 17, 33, 9, 41]}, {"prompt_token_ids": [60, 7, 7, 12]},
           {"prompt_token_ids": [11, 90, 4]}, {"prompt_token_ids": [8, 21, 70, 3, 3, 9]}]


@pytest.mark.parametrize("kind", ["column", "qkv"])
def test_an_overflowing_slot_reaches_only_its_own_rows(kind):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 12) if kind == "column" else QKVParallelLinear(8, 2, 4, 2)
    layer = layer.to(f64)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    step = LoRAStep(4, f64, torch.device("cpu"))
    faults = []
    step.on_faults = faults.append  # an attribute the old code did not read: harmless there
    layer.lora = LinearLoRA(step, DECODER, shards_of(layer), 8, 3, f64, torch.device("cpu"))
    good = [(torch.randn(4, 8, dtype=f64), torch.randn(size, 4, dtype=f64)) for _, size in shards_of(layer)]
    for k, (a, b) in enumerate(good):
        layer.lora.set_slot(2, k, a, b)
        # Finite in float64, but x A^T overflows it: 1e308 summed over 8 inputs.
        layer.lora.set_slot(0, k, torch.full((4, 8), 1e308, dtype=f64), torch.ones(b.shape, dtype=f64))
    slots = torch.tensor([2, -1, 0, 2, -1, 0, 2])
    x = torch.randn(len(slots), 8, dtype=f64)
    base = layer(x)  # outside a step: the base weights alone
    with step.active(slots, torch.empty(0, dtype=torch.long)):
        got = layer(x)
    delta = torch.cat([b @ a for a, b in good])  # [out, in]: slot 2's merged update, shard by shard
    for i, slot in enumerate(slots.tolist()):
        if slot == 0:
            continue
        want = base[i] + (delta @ x[i] if slot == 2 else 0)
        assert torch.isfinite(got[i]).all(), f"row {i} (slot {slot}) took another slot's overflow"
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
    # The overflow is its own rows' and reported as theirs; it never reaches the output.
    assert torch.isfinite(got).all()
    assert [set(f) for f in faults] == [{0}]


def _overflowing(good, out):
    """The good adapter with every lora_A 1e38: finite, so the NaN / inf check passes."""
    import shutil

    shutil.copytree(good, out)
    f = out / "adapter_model.safetensors"
    tensors = load_file(f)
    for name, t in tensors.items():
        if "lora_A" in name:
            t.fill_(1e38)
    save_file(tensors, f)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_isolation")
    base = make_bart(root / "base", seed=4)
    good = make_adapter(base, root / "good", ["q_proj", "v_proj", "fc1"], seed=7)
    return base, good, _overflowing(good, root / "bad")


def _alone(llm, ok):
    return [llm.generate([p], GREEDY, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
            for p, lora in zip(PROMPTS[:3], [ok, None, None])]


@pytest.mark.parametrize("guard", ["refused when mapped", "caught in the step"])
def test_an_overflowing_adapter_fails_alone_and_never_a_step(setup, guard, monkeypatch):
    base, good, bad_dir = setup
    if guard == "caught in the step":  # the load check off: the step's own guard must hold
        monkeypatch.setattr("tandem.lora.mapping.check_magnitudes", lambda *a, **k: None)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4)
    ok = LoRARequest("good", 1, str(good))
    alone = _alone(llm, ok)
    # More rounds than max_consecutive_step_failures (3): were any step failed, the engine would be dead.
    for round_ in range(4):
        bad = LoRARequest("bad", 2 + round_, str(bad_dir))  # a new id: read (and refused) again
        outs = llm.generate(PROMPTS, GREEDY, lora_request=[ok, None, None, bad], use_tqdm=False)
        for i, out in enumerate(outs[:3]):
            assert out.error is None, (guard, i, out.error)
            assert list(out.outputs[0].token_ids) == list(alone[i]), (guard, i)
        error = outs[3].error
        assert error is not None and error.startswith(f"LoRA adapter 'bad' ({bad_dir})"), error
        if guard == "refused when mapped":
            assert "lora_A's largest row sum of |values| is" in error and "overflow float32" in error, error
    health = llm.llm_engine.health()
    assert (health.status, health.failed_steps) == ("ok", 0), health
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("n, in_order", [(300, False), (5000, False), (300, True), (40, True)])
def test_many_rows_take_the_per_shard_path_with_the_same_result(n, in_order):
    """Past FEW_ROWS (256) rows a fused layer runs one GEMM per shard, and past 4096 the step
    sorts its rows with tensor ops; rows already in slot order (every token with an adapter)
    are updated in place, without a gather: every row still gets its own adapter's merged update."""
    torch.manual_seed(n)
    layer = QKVParallelLinear(8, 2, 4, 2).to(f64)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    step = LoRAStep(4, f64, torch.device("cpu"))
    layer.lora = LinearLoRA(step, DECODER, shards_of(layer), 8, 4, f64, torch.device("cpu"))
    deltas = {}
    for slot, rank in ((0, 4), (1, 2), (3, 3)):
        parts = [(torch.randn(rank, 8, dtype=f64), torch.randn(size, rank, dtype=f64)) for _, size in shards_of(layer)]
        if slot == 1:  # adapts q and v only
            parts[1] = None
        for k, part in enumerate(parts):
            if part is not None:
                layer.lora.set_slot(slot, k, *part)
        deltas[slot] = torch.cat([torch.zeros(size, 8, dtype=f64) if p is None else p[1] @ p[0]
                                  for p, (_, size) in zip(parts, shards_of(layer))])
    slots = torch.tensor([-1, 0, 1, 3])[torch.randint(0, 4, (n,))]
    if in_order:
        slots = torch.tensor([0, 1, 3])[torch.randint(0, 3, (n,))].sort().values
    x = torch.randn(n, 8, dtype=f64)
    base = layer(x)
    with step.active(slots, torch.empty(0, dtype=torch.long)):
        got = layer(x)
    want = base.clone()
    for slot, delta in deltas.items():
        rows = slots == slot
        want[rows] += x[rows] @ delta.t()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_exception_in_an_update_fails_the_adapters_rows_not_the_step():
    """Whatever raises inside the adapters' update (here a slot buffer of the wrong dtype),
    the layer returns the base output for the rows without an adapter and reports every
    slot in use with the cause, instead of failing the step."""
    torch.manual_seed(2)
    layer = ColumnParallelLinear(8, 6).to(f64)
    layer.weight.data.normal_()
    step = LoRAStep(4, f64, torch.device("cpu"))
    faults = []
    step.on_faults = faults.append
    layer.lora = LinearLoRA(step, DECODER, shards_of(layer), 8, 2, f64, torch.device("cpu"))
    layer.lora.set_slot(1, 0, torch.randn(4, 8, dtype=f64), torch.randn(6, 4, dtype=f64))
    layer.lora.a = layer.lora.a.float()  # torch.mm raises: float64 rows times float32 weights
    slots = torch.tensor([-1, 1, -1, 1])
    x = torch.randn(4, 8, dtype=f64)
    base = layer(x)
    with step.active(slots, torch.empty(0, dtype=torch.long)):
        got = layer(x)
    torch.testing.assert_close(got[[0, 2]], base[[0, 2]], rtol=0, atol=0)
    assert len(faults) == 1 and set(faults[0]) == {1}
    assert faults[0][1].startswith("its low-rank update failed: RuntimeError: ")
