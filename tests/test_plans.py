"""Launch plans (cupyflash/_launch.py ``_planned``): a call's launches recorded once per
signature and replayed with the addresses of later calls' arrays; and the checked signatures
(cupyflash/api.py ``_signature``), with which a repeated call skips its checks. The CPU tests
take the parameters apart and put them together again with stand-in arrays; the GPU tests
compare a replayed call with a freshly prepared one (and every GPU test runs with
CUPYFLASH_CHECK_PLANS=1, tests/conftest.py, which checks each replayed plan against a fresh
preparation of its call)."""
import os
from types import SimpleNamespace

import numpy as np
import pytest

from cupyflash import _launch, api


def fake(ptr, shape, strides, itemsize=2):
    """What a plan reads of a CuPy array."""
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), shape=shape, strides=strides, itemsize=itemsize,
                           size=int(np.prod(shape)))


def test_address_words_are_the_uint64_fields_but_the_seed():
    words, maps = _launch._address_words(_launch.FWD_PARAMS)
    fields = _launch.FWD_PARAMS.fields
    assert maps == ()
    assert fields["q"][1] // 8 in words and fields["lse"][1] // 8 in words
    seed = fields["drop"][1] + _launch.DROPOUT_PARAMS.fields["seed"][1]
    assert seed // 8 not in words
    user = fields["user"][1]
    assert all((user + 8 * i) // 8 in words for i in range(2 * _launch.USER_ARRAYS))
    _, maps = _launch._address_words(_launch.FWD_SM90_PARAMS)
    assert maps == tuple(_launch.FWD_SM90_PARAMS.fields[n][1] // 8 for n in ("q", "k", "v", "o"))
    assert _launch._address_words(np.dtype(np.uint64)) == ((0,), ())
    assert _launch._address_words(np.dtype(np.int32)) == ((), ())


def test_a_parameter_is_rebuilt_for_other_arrays():
    q = fake(0x7F0000001000, (2, 64, 4, 128), (65536, 1024, 256, 2))
    stats = fake(0x7F0000900000, (2, 2, 4, 64), (2048, 1024, 256, 4), 4)
    p = np.zeros((), _launch.BWD_PARAMS)
    _launch._tensor_ref(p["q"], q)
    p["dsum"], p["lse_log2"] = stats.data.ptr, stats.data.ptr + 2048
    p["seqlen_q"], p["scale"] = 64, 0.125
    p["drop"]["seed"] = q.data.ptr   # a seed that looks like an address stays a seed
    spans = [(a.data.ptr, a.data.ptr + _launch._extent(a)) for a in (q, stats)]
    arg = _launch._ArgPlan.of(np.array(p[()]), spans, {})
    assert sorted(zip(arg.sources.tolist(), arg.deltas.tolist())) == [(0, 0), (1, 0), (1, 2048)]
    again = arg.fill(np.array([0x7F0000001000, 0x7F0000900000], np.uint64))
    assert again.tobytes() == p[()].tobytes()
    moved = arg.fill(np.array([0x7A0000000000, 0x7B0000000000], np.uint64))
    assert moved["q"]["ptr"] == 0x7A0000000000 and moved["q"]["row_stride"] == 512
    assert moved["lse_log2"] == 0x7B0000000000 + 2048 and moved["scale"] == 0.125
    assert moved["drop"]["seed"] == q.data.ptr
    scalar = _launch._ArgPlan.of(np.array(np.uint64(stats.data.ptr)), spans, {})
    assert scalar.fill(np.array([1, 0x7B0000000000], np.uint64)) == np.uint64(0x7B0000000000)


def test_an_address_of_no_array_of_the_call_makes_no_plan():
    q = fake(0x7F0000001000, (1, 16, 1, 64), (2048, 128, 128, 2))
    p = np.zeros((), _launch.FWD_PARAMS)
    p["lse"] = 0x7E0000000000
    assert _launch._ArgPlan.of(np.array(p[()]), [(q.data.ptr, q.data.ptr + _launch._extent(q))], {}) is None


def test_an_address_inside_two_arrays_is_ambiguous():
    spans = [(0x1000, 0x3000), (0x2000, 0x4000)]
    assert _launch._source(0x2000, spans) == 1   # the one that starts there
    assert _launch._source(0x1800, spans) == 0
    assert _launch._source(0x2800, spans) is None


def test_a_signature_tells_option_types_apart():
    """A value that passed the checks must not let an equal one of another type skip them
    (``causal=1`` is refused where ``causal=True`` is not)."""
    assert api._typed(True) != api._typed(1)
    assert api._typed((-1, -1)) != api._typed((-1.0, -1))
    assert api._typed((-1, -1)) == api._typed((-1, -1))
    assert api._signature((np.zeros(3),), ("fwd",)) is None   # NumPy arrays are always checked
    assert api._signature((), ("fwd", [-1, -1])) is None      # a list is unhashable


@pytest.mark.gpu
def test_gpu_a_checked_signature_still_refuses_what_it_did_not_check():
    import cupy as cp
    import ml_dtypes

    import cupyflash as cf
    q = cp.zeros((1, 64, 2, 64), ml_dtypes.bfloat16)
    cf.flash_attention(q, q, q, causal=True)
    cf.flash_attention(q, q, q, causal=True)   # the checked signature
    with pytest.raises(TypeError, match="causal"):
        cf.flash_attention(q, q, q, causal=1)
    with pytest.raises(ValueError, match="shape"):
        cf.flash_attention(q, q[:, :32], q, causal=True)
    cf.flash_attention(q, q, q, dropout_p=0.25, seed=1)
    with pytest.raises(ValueError, match="seed"):   # seed and offset are checked at every call
        cf.flash_attention(q, q, q, dropout_p=0.25)
    cache = cp.zeros((1, 64, 2, 64), ml_dtypes.bfloat16)
    new = cp.zeros((1, 1, 2, 64), ml_dtypes.bfloat16)
    for _ in range(2):
        cf.flash_attention_with_kvcache(q[:, :1], cache, cache.copy(), k=new, v=new,
                                        cache_seqlens=cp.asarray(np.array([10], np.int32)))
    with pytest.raises(ValueError, match="cache"):   # the lengths are read again at every call
        cf.flash_attention_with_kvcache(q[:, :1], cache, cache.copy(), k=new, v=new,
                                        cache_seqlens=cp.asarray(np.array([64], np.int32)))
    cu = cp.asarray(np.array([0, 64], np.int32))
    cf.flash_attention_varlen(q[0], q[0], q[0], cu, cu, 64, 64)
    bad = cp.asarray(np.array([0, 65], np.int32))   # the offsets are read again at every call
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        cf.flash_attention_varlen(q[0], q[0], q[0], bad, cu, 64, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "causal_d64", "varlen", "backward", "varlen_backward",
                                  "decode_paged", "append", "dropout"])
def test_gpu_a_replayed_call_equals_a_fresh_one(case, monkeypatch):
    """The same call through its checked signature and its plan (new arrays, so new
    addresses; decode has no plan) and checked and prepared afresh (CUPYFLASH_LAUNCH_PLANS=0)
    give bit-identical results (the backward's deterministic dQ)."""
    import cupy as cp
    import ml_dtypes

    import cupyflash as cf

    def randn(*shape):
        return cp.random.standard_normal(shape, dtype=cp.float32).astype(ml_dtypes.bfloat16)

    def call(plans):
        monkeypatch.setenv("CUPYFLASH_LAUNCH_PLANS", "1" if plans else "0")
        cp.random.seed(7)
        if case in ("dense", "causal_d64", "backward"):
            d = 64 if case == "causal_d64" else 128
            q, k, v = (randn(2, 333, 4, d) for _ in range(3))
            if case != "backward":
                return cf.flash_attention(q, k, v, causal=case != "dense", return_lse=True)
            out, lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
            return cf.flash_attention_backward(randn(*q.shape), q, k, v, out, lse, causal=True,
                                               deterministic=True)
        if case == "dropout":   # a new offset at every step, under one signature
            q, k, v = (randn(2, 333, 4, 128) for _ in range(3))
            for offset in range(3):
                out = cf.flash_attention(q, k, v, dropout_p=0.25, seed=5, offset=offset, return_lse=True)
            return out
        if case in ("decode_paged", "append"):
            kc, vc = randn(40, 16, 2, 128), randn(40, 16, 2, 128)
            table = cp.asarray(np.random.default_rng(0).permutation(40).astype(np.int32).reshape(2, 20))
            lens = cp.asarray(np.array([17, 300], np.int32))
            new = {"k": randn(2, 1, 2, 128), "v": randn(2, 1, 2, 128)} if case == "append" else {}
            out = cf.flash_attention_with_kvcache(randn(2, 1, 8, 128), kc, vc, cache_seqlens=lens,
                                                  block_table=table, return_lse=True, **new)
            return (*out, kc, vc)
        cu = cp.asarray(np.array([0, 5, 300, 301, 700], np.int32))
        q, k, v = (randn(700, 4, 128) for _ in range(3))
        out, lse = cf.flash_attention_varlen(q, k, v, cu, cu, 399, 399, causal=True, return_lse=True)
        if case == "varlen":
            return out, lse
        return cf.flash_attention_varlen_backward(randn(*q.shape), q, k, v, out, lse, cu, cu, 399, 399,
                                                  causal=True, deterministic=True)

    fresh = call(False)
    for _ in range(3):   # the first call records the plan, the others replay it
        planned = call(True)
    assert os.environ.get("CUPYFLASH_CHECK_PLANS") == "1"
    for a, b in zip(fresh, planned):
        np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint8), cp.asnumpy(b).view(np.uint8))
