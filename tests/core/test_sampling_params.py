"""SamplingParams checks every field at construction, then cannot change."""

import dataclasses
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from tandem import SamplingParams

NAN, INF = float("nan"), float("inf")

BAD = [
    # (field, value, exception, words the reason must contain)
    ("n", 2.0, TypeError, "integer"),
    ("n", "2", TypeError, "integer"),
    ("n", True, TypeError, "integer"),
    ("n", None, TypeError, "integer"),
    ("n", 0, ValueError, ">= 1"),
    ("n", -3, ValueError, ">= 1"),
    ("temperature", "hot", TypeError, "real number"),
    ("temperature", None, TypeError, "real number"),
    ("temperature", True, TypeError, "real number"),
    ("temperature", 1j, TypeError, "real number"),
    ("temperature", NAN, ValueError, "finite"),
    ("temperature", INF, ValueError, "finite"),
    ("temperature", -INF, ValueError, "finite"),
    ("temperature", -1, ValueError, "[0, 3.4e38]"),
    ("temperature", -0.5, ValueError, "[0, 3.4e38]"),
    ("top_k", "5", TypeError, "integer"),
    ("top_k", 5.0, TypeError, "integer"),
    ("top_k", False, TypeError, "integer"),
    ("top_k", -2, ValueError, ">= 1"),
    ("top_p", "0.9", TypeError, "real number"),
    ("top_p", None, TypeError, "real number"),
    ("top_p", NAN, ValueError, "finite"),
    ("top_p", INF, ValueError, "finite"),
    ("top_p", 0.0, ValueError, "[1.2e-38, 1]"),
    ("top_p", -0.1, ValueError, "[1.2e-38, 1]"),
    ("top_p", 1.5, ValueError, "[1.2e-38, 1]"),
    ("min_p", "0", TypeError, "real number"),
    ("min_p", NAN, ValueError, "finite"),
    ("min_p", -INF, ValueError, "finite"),
    ("min_p", -0.1, ValueError, "[0, 1]"),
    ("min_p", 1.01, ValueError, "[0, 1]"),
    ("seed", 1.5, TypeError, "integer"),
    ("seed", "42", TypeError, "integer"),
    ("seed", True, TypeError, "integer"),
    ("seed", 2**64, ValueError, "2**64 - 1"),
    ("seed", -(2**63) - 1, ValueError, "-2**63"),
    ("max_tokens", True, TypeError, "integer"),
    ("max_tokens", 16.0, TypeError, "integer"),
    ("max_tokens", 0, ValueError, ">= 1"),
    ("max_tokens", -1, ValueError, ">= 1"),
    ("min_tokens", 1.0, TypeError, "integer"),
    ("min_tokens", False, TypeError, "integer"),
    ("min_tokens", -1, ValueError, ">= 0"),
    ("min_tokens", 17, ValueError, "<= max_tokens (16)"),
    ("stop", 1, TypeError, "strings"),
    ("stop", [1], TypeError, "item 0 is int"),
    ("stop", ["a", None], TypeError, "item 1 is NoneType"),
    ("stop", {"a"}, TypeError, "strings"),
    ("stop", b"a", TypeError, "strings"),
    ("stop", "", ValueError, "empty"),
    ("stop", ["a", ""], ValueError, "empty string (item 1)"),
    ("stop_token_ids", "5", TypeError, "list of integers"),
    ("stop_token_ids", 5, TypeError, "list of integers"),
    ("stop_token_ids", {5}, TypeError, "list of integers"),
    ("stop_token_ids", [1.5], TypeError, "item 0 is float"),
    ("stop_token_ids", [1, True], TypeError, "item 1 is bool"),
    ("stop_token_ids", [3, "4"], TypeError, "item 1 is str"),
    ("stop_token_ids", [3, -1], ValueError, "item 1 is -1"),
    ("ignore_eos", 1, TypeError, "True or False"),
    ("ignore_eos", "yes", TypeError, "True or False"),
    ("ignore_eos", None, TypeError, "True or False"),
    ("ignore_eos", np.bool_(True), TypeError, "True or False"),
    ("skip_special_tokens", 0, TypeError, "True or False"),
    ("skip_special_tokens", "False", TypeError, "True or False"),
    ("logprobs", 1.0, TypeError, "integer"),
    ("logprobs", "3", TypeError, "integer"),
    ("logprobs", True, TypeError, "integer"),
    ("logprobs", -1, ValueError, ">= 0"),
]


@pytest.mark.parametrize(
    "name, value, exc, why", BAD, ids=[f"{n}={v!r}" for n, v, _, _ in BAD]
)
def test_bad_values_name_the_field_and_the_value(name, value, exc, why):
    with pytest.raises(exc) as info:
        SamplingParams(**{name: value})
    assert type(info.value) is exc
    msg = str(info.value)
    assert msg.startswith(f"SamplingParams.{name}={value!r}: "), msg
    assert why in msg, msg


def test_type_errors_say_what_was_given():
    with pytest.raises(TypeError, match=re.escape("SamplingParams.temperature='hot': must be a real number in [0, 3.4e38] (float32's range), not str")):
        SamplingParams(temperature="hot")
    with pytest.raises(TypeError, match=re.escape("SamplingParams.n=2.0: must be an integer >= 1, not float")):
        SamplingParams(n=2.0)


def test_wrong_type_is_reported_before_range():
    # A string must not reach a comparison (which would raise an unrelated TypeError).
    with pytest.raises(TypeError, match=r"SamplingParams\.min_tokens='9'"):
        SamplingParams(min_tokens="9", max_tokens=4)


def test_int_too_large_for_a_float_is_not_finite():
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature=1000.*\.\.\.: must be finite"):
        SamplingParams(temperature=10**400)


def test_long_values_are_shortened_in_messages():
    with pytest.raises(ValueError) as info:
        SamplingParams(stop_token_ids=list(range(10_000)) + [-1])
    assert len(str(info.value)) < 400 and "item 10000 is -1" in str(info.value)


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, -1, 1.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.stop is None and p.stop_strings == () and p.stop_token_ids == ()
    assert p.ignore_eos is False and p.skip_special_tokens is True and not p.greedy


@pytest.mark.parametrize(
    "kwargs, expect",
    [
        (dict(n=np.int64(3)), dict(n=3)),
        (dict(temperature=np.float32(0.5)), dict(temperature=0.5)),
        (dict(temperature=np.float64(0.0)), dict(temperature=0.0)),
        (dict(temperature=2), dict(temperature=2.0)),
        (dict(temperature=Fraction(1, 4)), dict(temperature=0.25)),
        (dict(top_k=0), dict(top_k=-1)),
        (dict(top_k=-1), dict(top_k=-1)),
        (dict(top_k=np.int32(5)), dict(top_k=5)),
        (dict(top_p=1), dict(top_p=1.0)),
        (dict(top_p=np.float16(0.5)), dict(top_p=0.5)),
        (dict(min_p=1), dict(min_p=1.0)),
        (dict(seed=np.uint64(2**64 - 1)), dict(seed=2**64 - 1)),
        (dict(seed=-(2**63)), dict(seed=-(2**63))),
        (dict(seed=0), dict(seed=0)),
        (dict(max_tokens=np.int16(4), min_tokens=np.uint8(4)), dict(max_tokens=4, min_tokens=4)),
        (dict(logprobs=0), dict(logprobs=0)),
        (dict(logprobs=np.int64(5)), dict(logprobs=5)),
        (dict(stop="x"), dict(stop="x", stop_strings=("x",))),
        (dict(stop=["a", "bc"]), dict(stop=("a", "bc"), stop_strings=("a", "bc"))),
        (dict(stop=("a",)), dict(stop=("a",), stop_strings=("a",))),
        (dict(stop=[]), dict(stop=(), stop_strings=())),
        (dict(stop_token_ids=[np.int64(7), 0]), dict(stop_token_ids=(7, 0))),
        (dict(stop_token_ids=(2,)), dict(stop_token_ids=(2,))),
        (dict(ignore_eos=True, skip_special_tokens=False), dict(ignore_eos=True, skip_special_tokens=False)),
    ],
)
def test_good_values_are_accepted_and_normalised(kwargs, expect):
    p = SamplingParams(**kwargs)
    for name, want in expect.items():
        got = getattr(p, name)
        assert got == want and type(got) is type(want), (name, got)
    for name in ("stop_token_ids",):
        assert all(type(t) is int for t in getattr(p, name))


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.1).greedy


def test_every_accepted_seed_seeds_torch():
    draws = {}
    for seed in (-(2**63), -1, 0, 2**63, 2**64 - 1):
        kept = SamplingParams(seed=seed).seed
        assert kept == seed and type(kept) is int
        gen = torch.Generator().manual_seed(kept)
        # torch reads a seed as 64 bits: a negative one is its two's complement.
        assert gen.initial_seed() == seed % 2**64
        draws[seed] = torch.rand(4, generator=gen).tolist()
        assert torch.rand(4, generator=torch.Generator().manual_seed(kept)).tolist() == draws[seed]
    # Seeds with the same 64 bits are the same stream.
    assert draws[-(2**63)] == draws[2**63] and draws[-1] == draws[2**64 - 1]


def test_frozen():
    p = SamplingParams(max_tokens=8, stop_token_ids=[3])
    for name, value in [("max_tokens", 9), ("temperature", NAN), ("stop_strings", ("x",)), ("new_attr", 1)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(p, name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        del p.max_tokens
    with pytest.raises(AttributeError):  # a tuple has no append
        p.stop_token_ids.append(5)
    assert p.max_tokens == 8 and p.stop_token_ids == (3,)


def test_caller_lists_are_copied_not_aliased():
    ids, stop = [3, 4], ["end"]
    p = SamplingParams(stop_token_ids=ids, stop=stop)
    ids.append(-1)
    ids[0] = 99
    stop.append("")
    stop[0] = "other"
    assert p.stop_token_ids == (3, 4)
    assert p.stop == ("end",) and p.stop_strings == ("end",)


def test_replace_revalidates():
    p = SamplingParams(temperature=0.5, max_tokens=8, min_tokens=2, top_k=0, stop=["a"], stop_token_ids=[1])
    q = dataclasses.replace(p, max_tokens=5)
    assert q.max_tokens == 5 and q.temperature == 0.5 and q.top_k == -1
    assert q.stop_strings == ("a",) and q.stop_token_ids == (1,)
    assert p.max_tokens == 8
    assert dataclasses.replace(p, stop="zz").stop_strings == ("zz",)
    with pytest.raises(ValueError, match=r"SamplingParams\.max_tokens=0"):
        dataclasses.replace(p, max_tokens=0)
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens=2: must be <= max_tokens \(1\)"):
        dataclasses.replace(p, max_tokens=1)
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature=nan"):
        dataclasses.replace(p, temperature=NAN)
    with pytest.raises(TypeError, match=r"SamplingParams\.stop_token_ids='5'"):
        dataclasses.replace(p, stop_token_ids="5")


def test_equal_params_hash_equal():
    a = SamplingParams(stop=["a"], stop_token_ids=[1, 2], top_k=0, n=np.int64(2))
    b = SamplingParams(stop=("a",), stop_token_ids=(1, 2), top_k=-1, n=2)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, SamplingParams()}) == 2
    assert a != dataclasses.replace(a, seed=1)


def test_stop_token_ids_index_one_row_in_torch():
    # The sampler writes logits[i, params.stop_token_ids]: a tuple there must
    # pick columns of row i, as a list would.
    p = SamplingParams(stop_token_ids=[1, 3])
    logits = torch.zeros(2, 5)
    logits[1, p.stop_token_ids] = -math.inf
    assert logits[0].isfinite().all()
    assert logits[1].isinf().tolist() == [False, True, False, True, False]
    one = SamplingParams(stop_token_ids=[4])
    logits[0, one.stop_token_ids] = -math.inf
    assert logits[0].isinf().tolist() == [False, False, False, False, True]
