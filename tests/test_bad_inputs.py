"""One table of bad calls across the public functions, the mask builders and the CLI.

Each row is a call that must be refused. For every row the test checks: the exception type
(NumPy's conventions: TypeError for types, ValueError for values; the CLI exits with status 2
and a usage message), that the message names the argument, that nothing ran (no kernel
launch, the NumPy path not entered) and that no array the caller holds changed. The table
runs on NumPy arrays everywhere and again on CuPy arrays where there is a GPU, where 1,000
rejected calls must also leave CuPy's memory pool where it was.
"""
import dataclasses
import gc
import re
from typing import Callable

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import __main__ as cli
from cupyflash import _launch, _numpy_backend, masks

SHAPE_Q, SHAPE_KV = (2, 33, 4, 16), (2, 47, 2, 16)


@dataclasses.dataclass(frozen=True)
class Bad:
    id: str
    call: Callable          # call(a): the bad call, made from the arrays of ``a``
    error: type             # expected exception type (SystemExit: a CLI usage error)
    name: str               # the argument the message must name


class Arrays:
    """Fresh float32 inputs of one call, with a real forward's out and lse, in ``xp``."""

    def __init__(self, xp, seed):
        rng = np.random.default_rng(seed)
        host = [rng.standard_normal(s).astype(np.float32)
                for s in (SHAPE_Q, SHAPE_KV, SHAPE_KV, SHAPE_Q)]
        self.xp = xp
        self.q, self.k, self.v, self.dout = (xp.asarray(h) for h in host)
        self.out, self.lse = cf.flash_attention(self.q, self.k, self.v, return_lse=True)

    def arrays(self):
        return {n: getattr(self, n) for n in ("q", "k", "v", "dout", "out", "lse")}

    def bwd(self, **kw):
        return cf.flash_attention_backward(self.dout, self.q, self.k, self.v, self.out,
                                           self.lse, **kw)

    def mask(self, **kw):
        """A mask of this call's geometry, 64 x 64 blocks (``kw`` overrides)."""
        args = dict(seqlen_q=SHAPE_Q[1], seqlen_k=SHAPE_KV[1], block_size=64)
        args.update(kw)
        return masks.causal(**args)


def fwd(a, **kw):
    return cf.flash_attention(a.q, a.k, a.v, **kw)


def grid(nbq=1, nbk=1, dtype=bool):
    return np.ones((nbq, nbk), dtype)


API = [
    # flash_attention: the arrays
    Bad("q-list", lambda a: cf.flash_attention([[1.0]], a.k, a.v), TypeError, "q"),
    Bad("k-none", lambda a: cf.flash_attention(a.q, None, a.v), TypeError, "k"),
    Bad("v-str", lambda a: cf.flash_attention(a.q, a.k, "v"), TypeError, "v"),
    Bad("q-int32", lambda a: cf.flash_attention(a.q.astype(np.int32), a.k, a.v), TypeError, "q"),
    Bad("k-complex", lambda a: cf.flash_attention(a.q, a.k.astype(np.complex64), a.v),
        TypeError, "k"),
    Bad("v-bool", lambda a: cf.flash_attention(a.q, a.k, a.v > 0), TypeError, "v"),
    Bad("v-float64-mix", lambda a: cf.flash_attention(a.q, a.k, a.v.astype(np.float64)),
        TypeError, "v"),
    Bad("q-3d", lambda a: cf.flash_attention(a.q[0], a.k, a.v), ValueError, "q"),
    Bad("k-5d", lambda a: cf.flash_attention(a.q, a.k[None], a.v), ValueError, "k"),
    Bad("v-shape", lambda a: cf.flash_attention(a.q, a.k, a.v[:, :-1]), ValueError, "v"),
    Bad("k-batch", lambda a: cf.flash_attention(a.q, a.k[:1], a.v[:1]), ValueError, "k"),
    Bad("k-headdim", lambda a: cf.flash_attention(a.q, a.k[..., :8], a.v[..., :8]),
        ValueError, "k"),
    Bad("nheads-not-multiple", lambda a: cf.flash_attention(a.q[:, :, :3], a.k, a.v),
        ValueError, "nheads"),
    Bad("q-seqlen-0", lambda a: cf.flash_attention(a.q[:, :0], a.k, a.v), ValueError, "q"),
    Bad("q-headdim-257", lambda a: cf.flash_attention(
        a.xp.ones((1, 2, 1, 257), np.float32), a.xp.ones((1, 2, 1, 257), np.float32),
        a.xp.ones((1, 2, 1, 257), np.float32)), ValueError, "q"),
    Bad("q-last-dim-strided", lambda a: cf.flash_attention(
        a.xp.repeat(a.q, 2, axis=-1)[..., ::2], a.k, a.v), ValueError, "q"),
    # flash_attention: the keywords
    Bad("scale-0", lambda a: fwd(a, softmax_scale=0.0), ValueError, "softmax_scale"),
    Bad("scale-negative", lambda a: fwd(a, softmax_scale=-1.0), ValueError, "softmax_scale"),
    Bad("scale-nan", lambda a: fwd(a, softmax_scale=float("nan")), ValueError, "softmax_scale"),
    Bad("scale-inf", lambda a: fwd(a, softmax_scale=float("inf")), ValueError, "softmax_scale"),
    Bad("scale-str", lambda a: fwd(a, softmax_scale="0.5"), TypeError, "softmax_scale"),
    Bad("scale-bool", lambda a: fwd(a, softmax_scale=True), TypeError, "softmax_scale"),
    Bad("scale-complex", lambda a: fwd(a, softmax_scale=1j), TypeError, "softmax_scale"),
    Bad("scale-array", lambda a: fwd(a, softmax_scale=np.array([0.5])), TypeError,
        "softmax_scale"),
    Bad("scale-overflows-float32", lambda a: fwd(a, softmax_scale=3e38), ValueError,
        "softmax_scale"),
    Bad("causal-str-False", lambda a: fwd(a, causal="False"), TypeError, "causal"),
    Bad("causal-none", lambda a: fwd(a, causal=None), TypeError, "causal"),
    Bad("causal-int", lambda a: fwd(a, causal=1), TypeError, "causal"),
    Bad("causal-array", lambda a: fwd(a, causal=np.array([True])), TypeError, "causal"),
    Bad("return_lse-str", lambda a: fwd(a, return_lse="no"), TypeError, "return_lse"),
    Bad("return_lse-none", lambda a: fwd(a, return_lse=None), TypeError, "return_lse"),
    Bad("unknown-keyword", lambda a: fwd(a, return_attn_probs=True), TypeError,
        "return_attn_probs"),
    Bad("block_mask-array", lambda a: fwd(a, block_mask=grid()), TypeError, "block_mask"),
    Bad("block_mask-seqlen_q", lambda a: fwd(a, block_mask=a.mask(seqlen_q=SHAPE_Q[1] + 1)),
        ValueError, "block_mask"),
    Bad("block_mask-seqlen_k", lambda a: fwd(a, block_mask=a.mask(seqlen_k=SHAPE_KV[1] - 1)),
        ValueError, "block_mask"),
    Bad("block_mask-heads", lambda a: fwd(a, block_mask=cf.BlockMask.from_dense(
        np.ones((3, 1, 1), bool), 64, seqlen_q=SHAPE_Q[1], seqlen_k=SHAPE_KV[1])),
        ValueError, "block_mask"),
    # flash_attention: window_size, softcap, alibi_slopes
    Bad("window-int", lambda a: fwd(a, window_size=8), TypeError, "window_size"),
    Bad("window-none", lambda a: fwd(a, window_size=None), TypeError, "window_size"),
    Bad("window-array", lambda a: fwd(a, window_size=np.array([4, 4])), TypeError,
        "window_size"),
    Bad("window-one-entry", lambda a: fwd(a, window_size=(4,)), ValueError, "window_size"),
    Bad("window-three-entries", lambda a: fwd(a, window_size=(4, 4, 4)), ValueError,
        "window_size"),
    Bad("window-float", lambda a: fwd(a, window_size=(4.0, 0)), TypeError, "window_size"),
    Bad("window-bool", lambda a: fwd(a, window_size=(True, 0)), TypeError, "window_size"),
    Bad("window-str", lambda a: fwd(a, window_size=("4", 0)), TypeError, "window_size"),
    Bad("window-left-minus-2", lambda a: fwd(a, window_size=(-2, 0)), ValueError,
        "window_size"),
    Bad("window-right-minus-5", lambda a: fwd(a, window_size=(0, np.int64(-5))), ValueError,
        "window_size"),
    Bad("window-2**31", lambda a: fwd(a, window_size=(2**31, 0)), ValueError, "window_size"),
    Bad("window-with-block_mask", lambda a: fwd(a, window_size=(8, 0), block_mask=a.mask()),
        ValueError, "window_size"),
    Bad("block_mask-with-window", lambda a: fwd(a, window_size=(-1, 8), block_mask=a.mask()),
        ValueError, "block_mask"),
    Bad("softcap-negative", lambda a: fwd(a, softcap=-1.0), ValueError, "softcap"),
    Bad("softcap-nan", lambda a: fwd(a, softcap=float("nan")), ValueError, "softcap"),
    Bad("softcap-inf", lambda a: fwd(a, softcap=float("inf")), ValueError, "softcap"),
    Bad("softcap-none", lambda a: fwd(a, softcap=None), TypeError, "softcap"),
    Bad("softcap-str", lambda a: fwd(a, softcap="30"), TypeError, "softcap"),
    Bad("softcap-bool", lambda a: fwd(a, softcap=True), TypeError, "softcap"),
    Bad("softcap-array", lambda a: fwd(a, softcap=np.array([30.0])), TypeError, "softcap"),
    Bad("softcap-overflows-float32", lambda a: fwd(a, softcap=3e38), ValueError, "softcap"),
    Bad("softcap-underflows-float32", lambda a: fwd(a, softcap=1e-40), ValueError, "softcap"),
    Bad("alibi-list", lambda a: fwd(a, alibi_slopes=[0.5] * SHAPE_Q[2]), TypeError,
        "alibi_slopes"),
    Bad("alibi-float64", lambda a: fwd(a, alibi_slopes=a.xp.ones(SHAPE_Q[2], np.float64)),
        TypeError, "alibi_slopes"),
    Bad("alibi-float16", lambda a: fwd(a, alibi_slopes=a.xp.ones(SHAPE_Q[2], np.float16)),
        TypeError, "alibi_slopes"),
    Bad("alibi-int32", lambda a: fwd(a, alibi_slopes=a.xp.ones(SHAPE_Q[2], np.int32)),
        TypeError, "alibi_slopes"),
    Bad("alibi-nheads_k", lambda a: fwd(a, alibi_slopes=a.xp.ones(SHAPE_KV[2], np.float32)),
        ValueError, "alibi_slopes"),
    Bad("alibi-0d", lambda a: fwd(a, alibi_slopes=a.xp.ones((), np.float32)), ValueError,
        "alibi_slopes"),
    Bad("alibi-3d", lambda a: fwd(a, alibi_slopes=a.xp.ones((1,) + SHAPE_Q[::2], np.float32)),
        ValueError, "alibi_slopes"),
    Bad("alibi-batch", lambda a: fwd(a, alibi_slopes=a.xp.ones(
        (SHAPE_Q[0] + 1, SHAPE_Q[2]), np.float32)), ValueError, "alibi_slopes"),
    Bad("alibi-transposed", lambda a: fwd(a, alibi_slopes=a.xp.ones(
        (SHAPE_Q[2], SHAPE_Q[0]), np.float32)), ValueError, "alibi_slopes"),
    Bad("alibi-strided", lambda a: fwd(a, alibi_slopes=a.xp.ones(
        2 * SHAPE_Q[2], np.float32)[::2]), ValueError, "alibi_slopes"),
    # flash_attention: dropout_p, seed, offset
    Bad("dropout-negative", lambda a: fwd(a, dropout_p=-0.1, seed=0), ValueError, "dropout_p"),
    Bad("dropout-1", lambda a: fwd(a, dropout_p=1.0, seed=0), ValueError, "dropout_p"),
    Bad("dropout-nan", lambda a: fwd(a, dropout_p=float("nan"), seed=0), ValueError,
        "dropout_p"),
    Bad("dropout-str", lambda a: fwd(a, dropout_p="0.1", seed=0), TypeError, "dropout_p"),
    Bad("dropout-bool", lambda a: fwd(a, dropout_p=True, seed=0), TypeError, "dropout_p"),
    Bad("dropout-none", lambda a: fwd(a, dropout_p=None, seed=0), TypeError, "dropout_p"),
    Bad("dropout-array", lambda a: fwd(a, dropout_p=np.array([0.1]), seed=0), TypeError,
        "dropout_p"),
    Bad("dropout-without-seed", lambda a: fwd(a, dropout_p=0.1), ValueError, "seed"),
    Bad("seed-negative", lambda a: fwd(a, dropout_p=0.1, seed=-1), ValueError, "seed"),
    Bad("seed-2**64", lambda a: fwd(a, dropout_p=0.1, seed=2**64), ValueError, "seed"),
    Bad("seed-float", lambda a: fwd(a, dropout_p=0.1, seed=1.0), TypeError, "seed"),
    Bad("seed-str", lambda a: fwd(a, dropout_p=0.1, seed="1"), TypeError, "seed"),
    Bad("seed-bool", lambda a: fwd(a, dropout_p=0.1, seed=True), TypeError, "seed"),
    Bad("seed-float-without-dropout", lambda a: fwd(a, seed=0.5), TypeError, "seed"),
    Bad("offset-negative", lambda a: fwd(a, dropout_p=0.1, seed=0, offset=-1), ValueError,
        "offset"),
    Bad("offset-2**32", lambda a: fwd(a, dropout_p=0.1, seed=0, offset=2**32), ValueError,
        "offset"),
    Bad("offset-none", lambda a: fwd(a, dropout_p=0.1, seed=0, offset=None), TypeError,
        "offset"),
    Bad("offset-float", lambda a: fwd(a, offset=1.5), TypeError, "offset"),
    # flash_attention_backward
    Bad("bwd-dout-dtype", lambda a: cf.flash_attention_backward(
        a.dout.astype(np.float64), a.q, a.k, a.v, a.out, a.lse), TypeError, "dout"),
    Bad("bwd-dout-shape", lambda a: cf.flash_attention_backward(
        a.dout[:, :-1], a.q, a.k, a.v, a.out, a.lse), ValueError, "dout"),
    Bad("bwd-out-shape", lambda a: cf.flash_attention_backward(
        a.dout, a.q, a.k, a.v, a.out[:, 1:], a.lse), ValueError, "out"),
    Bad("bwd-dout-strided", lambda a: cf.flash_attention_backward(
        a.xp.repeat(a.dout, 2, axis=-1)[..., ::2], a.q, a.k, a.v, a.out, a.lse),
        ValueError, "dout"),
    Bad("bwd-lse-shape", lambda a: cf.flash_attention_backward(
        a.dout, a.q, a.k, a.v, a.out, a.lse[:, :, :-1]), ValueError, "lse"),
    Bad("bwd-lse-2d", lambda a: cf.flash_attention_backward(
        a.dout, a.q, a.k, a.v, a.out, a.lse[0]), ValueError, "lse"),
    Bad("bwd-lse-float16", lambda a: cf.flash_attention_backward(
        a.dout, a.q, a.k, a.v, a.out, a.lse.astype(np.float16)), TypeError, "lse"),
    Bad("bwd-lse-list", lambda a: cf.flash_attention_backward(
        a.dout, a.q, a.k, a.v, a.out, [0.0]), TypeError, "lse"),
    Bad("bwd-deterministic-2", lambda a: a.bwd(deterministic=2), TypeError, "deterministic"),
    Bad("bwd-deterministic-str", lambda a: a.bwd(deterministic="yes"), TypeError,
        "deterministic"),
    Bad("bwd-deterministic-none", lambda a: a.bwd(deterministic=None), TypeError,
        "deterministic"),
    Bad("bwd-causal-str", lambda a: a.bwd(causal="True"), TypeError, "causal"),
    Bad("bwd-scale-negative", lambda a: a.bwd(softmax_scale=-0.5), ValueError, "softmax_scale"),
    Bad("bwd-block_mask-seqlen", lambda a: a.bwd(block_mask=a.mask(seqlen_q=SHAPE_Q[1] - 1)),
        ValueError, "block_mask"),
    Bad("bwd-window-float", lambda a: a.bwd(window_size=(0.5, 0)), TypeError, "window_size"),
    Bad("bwd-window-with-block_mask", lambda a: a.bwd(window_size=(8, 8), block_mask=a.mask()),
        ValueError, "window_size"),
    Bad("bwd-softcap-negative", lambda a: a.bwd(softcap=-30.0), ValueError, "softcap"),
    Bad("bwd-alibi-float64", lambda a: a.bwd(alibi_slopes=a.xp.ones(SHAPE_Q[2], np.float64)),
        TypeError, "alibi_slopes"),
    Bad("bwd-alibi-shape", lambda a: a.bwd(alibi_slopes=a.xp.ones(3, np.float32)), ValueError,
        "alibi_slopes"),
    Bad("bwd-dropout-1", lambda a: a.bwd(dropout_p=1.0, seed=0), ValueError, "dropout_p"),
    Bad("bwd-dropout-without-seed", lambda a: a.bwd(dropout_p=0.5), ValueError, "seed"),
    Bad("bwd-seed-2**64", lambda a: a.bwd(dropout_p=0.5, seed=2**64), ValueError, "seed"),
    Bad("bwd-offset-str", lambda a: a.bwd(dropout_p=0.5, seed=1, offset="0"), TypeError,
        "offset"),
    # dropout_mask
    Bad("dropout_mask-p-1", lambda a: cf.dropout_mask(1, 2, 16, 16, 1.0, 0), ValueError,
        "dropout_p"),
    Bad("dropout_mask-seed-none", lambda a: cf.dropout_mask(1, 2, 16, 16, 0.1, None),
        ValueError, "seed"),
    Bad("dropout_mask-seed-none-p-0", lambda a: cf.dropout_mask(1, 2, 16, 16, 0.0, None),
        ValueError, "seed"),
    Bad("dropout_mask-offset-2**32", lambda a: cf.dropout_mask(1, 2, 16, 16, 0.1, 0, 2**32),
        ValueError, "offset"),
    Bad("dropout_mask-seqlen_q-float", lambda a: cf.dropout_mask(1, 2, 16.0, 16, 0.1, 0),
        TypeError, "seqlen_q"),
    Bad("dropout_mask-batch-negative", lambda a: cf.dropout_mask(-1, 2, 16, 16, 0.1, 0),
        ValueError, "batch"),
    # BlockMask.from_dense
    Bad("from_dense-int-grid", lambda a: cf.BlockMask.from_dense(
        grid(dtype=np.int32), 64, seqlen_q=64, seqlen_k=64), TypeError, "block_mask_bool"),
    Bad("from_dense-str-grid", lambda a: cf.BlockMask.from_dense(
        "all", 64, seqlen_q=64, seqlen_k=64), TypeError, "block_mask_bool"),
    Bad("from_dense-1d", lambda a: cf.BlockMask.from_dense(
        np.ones(2, bool), 64, seqlen_q=64, seqlen_k=128), ValueError, "block_mask_bool"),
    Bad("from_dense-shape", lambda a: cf.BlockMask.from_dense(
        grid(2, 3), 64, seqlen_q=64, seqlen_k=64), ValueError, "block_mask_bool"),
    Bad("from_dense-0-heads", lambda a: cf.BlockMask.from_dense(
        np.ones((0, 1, 1), bool), 64, seqlen_q=64, seqlen_k=64), ValueError, "block_mask_bool"),
    Bad("from_dense-block-32", lambda a: cf.BlockMask.from_dense(
        grid(), 32, seqlen_q=32, seqlen_k=32), ValueError, "block_size"),
    Bad("from_dense-block-triple", lambda a: cf.BlockMask.from_dense(
        grid(), (64, 64, 64), seqlen_q=64, seqlen_k=64), ValueError, "block_size"),
    Bad("from_dense-block-float", lambda a: cf.BlockMask.from_dense(
        grid(), 64.0, seqlen_q=64, seqlen_k=64), TypeError, "block_size"),
    Bad("from_dense-seqlen_q-0", lambda a: cf.BlockMask.from_dense(
        grid(), 64, seqlen_q=0, seqlen_k=64), ValueError, "seqlen_q"),
    Bad("from_dense-seqlen_k-str", lambda a: cf.BlockMask.from_dense(
        grid(), 64, seqlen_q=64, seqlen_k="64"), TypeError, "seqlen_k"),
    Bad("from_dense-causal-str", lambda a: cf.BlockMask.from_dense(
        grid(), 64, seqlen_q=64, seqlen_k=64, causal="yes"), TypeError, "causal"),
    Bad("tile_lists-tile_q-48", lambda a: a.mask().tile_lists(48, 64, False), ValueError,
        "tile_q"),
    Bad("tile_lists-causal-int", lambda a: a.mask().tile_lists(64, 64, 1), TypeError, "causal"),
    # the builders
    Bad("random-seed-str", lambda a: masks.random(64, 64, 0.5, seed="abc"), TypeError, "seed"),
    Bad("random-seed-none", lambda a: masks.random(64, 64, 0.5, seed=None), TypeError, "seed"),
    Bad("random-seed-negative", lambda a: masks.random(64, 64, 0.5, seed=-1), ValueError,
        "seed"),
    Bad("random-density-1.5", lambda a: masks.random(64, 64, 1.5, 0), ValueError, "density"),
    Bad("random-density-str", lambda a: masks.random(64, 64, "0.1", 0), TypeError, "density"),
    Bad("random-nheads-0", lambda a: masks.random(64, 64, 0.5, 0, nheads=0), ValueError,
        "nheads"),
    Bad("bigbird-seed-none", lambda a: masks.bigbird(256, 256, 64, 1, 1, seed=None), TypeError,
        "seed"),
    Bad("bigbird-random_blocks-negative", lambda a: masks.bigbird(256, 256, 64, 1, -1, 0),
        ValueError, "random_blocks"),
    Bad("sliding_window-window-0", lambda a: masks.sliding_window(64, 64, 0), ValueError,
        "window"),
    Bad("sliding_window-window-float", lambda a: masks.sliding_window(64, 64, 2.5), TypeError,
        "window"),
    Bad("strided-stride-0", lambda a: masks.strided(64, 64, 0), ValueError, "stride"),
    Bad("longformer-global-negative", lambda a: masks.longformer(64, 64, 8, -1), ValueError,
        "global_blocks"),
    Bad("causal-block-100", lambda a: masks.causal(64, 64, block_size=100), ValueError,
        "block_size"),
    Bad("causal-seqlen-negative", lambda a: masks.causal(-5, 64), ValueError, "seqlen_q"),
]

CLI = [
    Bad("cli-shape-headdim-300", lambda a: cli.main(["demo", "--shape", "1,100,2,300"]),
        SystemExit, "--shape"),
    Bad("cli-shape-three", lambda a: cli.main(["demo", "--shape", "1,2,3"]), SystemExit,
        "--shape"),
    Bad("cli-shape-words", lambda a: cli.main(["demo", "--shape", "a,b,c,d"]), SystemExit,
        "--shape"),
    Bad("cli-repeats-negative", lambda a: cli.main(["demo", "--repeats", "-1"]), SystemExit,
        "--repeats"),
    Bad("cli-repeats-0", lambda a: cli.main(["demo", "--repeats", "0"]), SystemExit,
        "--repeats"),
    Bad("cli-repeats-float", lambda a: cli.main(["demo", "--repeats", "1.5"]), SystemExit,
        "--repeats"),
    Bad("cli-dtype", lambda a: cli.main(["demo", "--dtype", "int8"]), SystemExit, "--dtype"),
    Bad("cli-bench-reps-0", lambda a: cli.main(["bench", "--reps", "0"]), SystemExit, "--reps"),
    Bad("cli-bench-warmup-negative", lambda a: cli.main(["bench", "--warmup", "-1"]),
        SystemExit, "--warmup"),
    Bad("cli-bench-impl", lambda a: cli.main(["bench", "--impl", "nope"]), SystemExit,
        "--impl"),
]

# Device arrays mixed with host ones (GPU only).
MIXED = [
    Bad("mixed-k-host", lambda a: cf.flash_attention(a.q, a.xp.asnumpy(a.k), a.v), TypeError,
        "k"),
    Bad("mixed-lse-host", lambda a: cf.flash_attention_backward(
        a.dout, a.q, a.k, a.v, a.out, a.xp.asnumpy(a.lse)), TypeError, "lse"),
    Bad("mixed-alibi-host", lambda a: fwd(a, alibi_slopes=np.ones(SHAPE_Q[2], np.float32)),
        TypeError, "alibi_slopes"),
]


def _ids(rows):
    return [pytest.param(r, id=r.id) for r in rows]


@pytest.fixture
def watch(monkeypatch):
    """``watch()`` starts recording every kernel launch and every entry into the NumPy path
    (call it once the inputs exist) and returns the list of what ran."""
    def start():
        ran = []

        def recorder(what):
            return lambda *args, **kw: ran.append(what)

        monkeypatch.setattr(_launch, "_launch", recorder("kernel launch"))
        monkeypatch.setattr(_numpy_backend, "forward", recorder("NumPy forward"))
        monkeypatch.setattr(_numpy_backend, "backward", recorder("NumPy backward"))
        return ran
    return start


def _snapshot(a):
    return {n: a.xp.asnumpy(x).copy() if a.xp is not np else x.copy()
            for n, x in a.arrays().items()}


def check_refused(bad, a, ran, capsys):
    before = _snapshot(a)
    with pytest.raises(bad.error) as info:
        bad.call(a)
    if bad.error is SystemExit:
        assert info.value.code == 2, f"exit status {info.value.code}, expected 2 (usage error)"
        message = capsys.readouterr().err
    else:
        message = str(info.value)
    assert re.search(rf"(?<![\w-]){re.escape(bad.name)}(?!\w)", message), \
        f"the message does not name {bad.name!r}: {message!r}"
    assert not ran, f"{', '.join(ran)} before the error"
    for name, old in before.items():
        new = getattr(a, name)
        new = new if a.xp is np else a.xp.asnumpy(new)
        assert np.array_equal(old, new), f"{name} changed"


def test_the_table_is_large_enough():
    assert len(API) + len(CLI) >= 60
    assert len({b.id for b in API + CLI + MIXED}) == len(API + CLI + MIXED)


@pytest.mark.parametrize("bad", _ids(API + CLI))
def test_bad_call_is_refused_on_numpy(bad, watch, capsys):
    a = Arrays(np, seed=len(bad.id))
    check_refused(bad, a, watch(), capsys)


@pytest.fixture(scope="module")
def cupy_arrays():
    import cupy
    return Arrays(cupy, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", _ids(API + MIXED))
def test_bad_call_is_refused_on_cupy(bad, cupy_arrays, watch, capsys):
    check_refused(bad, cupy_arrays, watch(), capsys)


@pytest.mark.gpu
def test_rejected_calls_leave_the_pool_where_it_was(cupy_arrays):
    import cupy
    pool = cupy.get_default_memory_pool()
    rows = API + MIXED

    def reject_all(n):
        for i in range(n):
            try:
                rows[i % len(rows)].call(cupy_arrays)
            except (TypeError, ValueError):
                pass
            else:
                raise AssertionError(f"{rows[i % len(rows)].id} was not refused")
        gc.collect()

    reject_all(len(rows))           # first touch: CuPy's own caches (e.g. astype kernels)
    used, held = pool.used_bytes(), pool.total_bytes()
    reject_all(1000)
    assert pool.used_bytes() == used, f"used bytes {used} -> {pool.used_bytes()}"
    assert pool.total_bytes() == held, f"pool bytes {held} -> {pool.total_bytes()}"
