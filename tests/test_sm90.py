"""Hopper's units through cuda/sm90.cuh and cupyflash/_tma.py, the pieces of the sm_90a kernels.

A probe kernel, one warpgroup: the copy engine brings a 64 x 128 block of q, k and v (rows of
any (batch, head), strided, with tails past the sequence) into 128-byte-swizzled shared
memory through tensor maps, completing on an mbarrier; wgmma computes S = Q K^T from shared
memory (K-major), then O = P V with P = S rounded to 16 bits in registers and V MN-major; the
fp32 results leave through the accumulator layout sm90.cuh documents. Checked against NumPy,
in bf16 and fp16, on an sm_90 GPU; compiled for sm_90a through NVRTC without one (no spills).
The tensor-map builder's refusals need no GPU either.

The Hopper forward (cuda/fwd_sm90.cu) against the float64 reference under FlashAttention's
rule: odd lengths (tails of query and key blocks), seqlen_q != seqlen_k both ways, GQA/MQA,
strided q (a slice of packed qkv), causal and local bands, rows that see no key, every
head-dim bucket (head dims below the kernel's 64-column multiple), softcap, ALiBi and a block
mask; each case asserts that the Hopper kernel is the one that ran (on an sm_90 GPU every other
GPU test of such a forward runs it too). Dropout, block masks of 64-row query blocks and rows
not 16-byte aligned go to the generic kernels.
"""
import re

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _compile, _config, _launch, _spec, _tma
from reference import assert_rule, attention_naive, attention_ref, random_array

PROBE = r"""
// S (64 x 64, fp32, row-major) = Q K^T over head dim 128 for query rows q0.. of head h and key
// rows k0.. of kv head hk in batch entry b; then O (64 x 128, fp32) = P V for those keys, P = S
// rounded to Elem and taken from registers, V read MN-major (its rows as the copy engine
// brings them).
template <typename Elem>
__global__ void __launch_bounds__(128) sm90_probe(const __grid_constant__ TmaDesc qmap,
                                                  const __grid_constant__ TmaDesc kmap,
                                                  const __grid_constant__ TmaDesc vmap, float* s, float* o,
                                                  int q0, int k0, int b, int h, int hk) {
    constexpr int ROWS = 64, HALF = 64, TILE = ROWS * HALF;   // one swizzled 64 x 64 sub-tile
    extern __shared__ unsigned char smem_raw[];
    __shared__ unsigned long long bar;
    // The swizzled tiles start at a 1024-byte boundary (1 KB extra is requested).
    unsigned char* base = smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024;
    u16* sq = reinterpret_cast<u16*>(base);
    u16* sk = sq + 2 * TILE;
    u16* sv = sk + 2 * TILE;
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_expect_bytes(&bar, 6 * TILE * 2);
        for (int half = 0; half < 2; ++half) {
            tma_load_4d(sq + half * TILE, qmap, half * HALF, h, q0, b, &bar);
            tma_load_4d(sk + half * TILE, kmap, half * HALF, hk, k0, b, &bar);
            tma_load_4d(sv + half * TILE, vmap, half * HALF, hk, k0, b, &bar);
        }
    }
    mbar_wait(&bar, 0);
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_ss<Elem>(d, sw128_desc(sq + half * TILE, kk * 32), sw128_desc(sk + half * TILE, kk * 32),
                                  half + kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[(16 * warp + g + 8 * (e / 2)) * ROWS + 8 * j + 2 * t + e % 2] = d[4 * j + e];
    // Keys 16kk.. of S are the n8 tiles 2kk and 2kk + 1: the A fragment of step kk.
    u32 a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) a[kk][r] = pack2<Elem>(d[8 * kk + 2 * r], d[8 * kk + 2 * r + 1]);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float acc[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)   // 16 keys are 16 rows of V: 2048 bytes
            wgmma_rs<Elem>(acc, a[kk], sw128_desc(sv + half * TILE, kk * 2048), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[(16 * warp + g + 8 * (e / 2)) * 128 + half * HALF + 8 * j + 2 * t + e % 2] = acc[4 * j + e];
    }
}
"""
NAMES = {"bfloat16": "sm90_probe<bf16>", "float16": "sm90_probe<fp16>"}


def probe_source():
    return _compile.source("sm90.cuh") + PROBE


def compile_probe(arch):
    """(cubin, {name: lowered name}, ptxas log) of the probe's instantiations for ``arch``."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    log, lowered, cubin = _compile.nvrtc_run(probe_source(), "sm90_probe.cu", NAMES.values(),
                                             arch, _compile.ptxas_log_options())
    return cubin, lowered, log


def test_probe_compiles_for_sm90a_without_local_memory():
    _, lowered, log = compile_probe("sm_90a")
    if "Compiling entry function" not in log:
        # NVRTC 13.0 (the lent H200's) prints no ptxas report for sm_90a; 13.5 (CI's) does.
        pytest.skip("this NVRTC prints no ptxas report for sm_90a")
    stats = _compile._parse_ptxas(log, {v: k for k, v in lowered.items()})
    assert set(stats) == set(NAMES.values()), log
    assert not any(any(s[1:]) for s in stats.values()), f"local memory: {stats}"


@pytest.mark.parametrize("kw,match", [
    (dict(ptr=8), "multiples of 16"),
    (dict(strides=(256, 24, 4096)), "multiples of 16"),
    (dict(box=(128, 1, 64, 1)), "128-byte swizzle"),
    (dict(box=(64, 1, 512, 1)), "box"),
    (dict(strides=(256,)), "rank 4"),
])
def test_tensor_map_refuses_what_the_copy_engine_cannot_describe(kw, match):
    args = dict(ptr=1 << 20, dtype="bfloat16", dims=(128, 2, 100, 3), strides=(256, 512, 51200),
                box=(64, 1, 64, 1))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        _tma.tiled(**args)


def _map(x, rows):
    """x (batch, seqlen, heads, 128), the last dimension contiguous: boxes of 64 x 64."""
    b, s, h, d = x.shape
    return _tma.tiled(x.data.ptr, x.dtype.name, (d, h, s, b),
                      (x.strides[2], x.strides[1], x.strides[0]), (64, 1, rows, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_probe_computes_qk_and_pv_from_tma_tiles_on_the_gpu(dtype, tmp_path):
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    import ml_dtypes
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    cubin, lowered, _ = compile_probe("sm_90a")
    (tmp_path / "probe.cubin").write_bytes(cubin)
    kernel = cupy.RawModule(path=str(tmp_path / "probe.cubin")).get_function(lowered[NAMES[dtype]])
    smem = 6 * 64 * 64 * 2 + 1024
    kernel.max_dynamic_shared_size_bytes = smem
    # q a slice of a packed (batch, seqlen, 3, heads, d) array: strided rows; k, v 2 heads.
    # Scaled so that S stays within fp16's range.
    packed = cupy.asarray((random_array(np, (2, 100, 3, 4, 128), np.float64, 7) / 4).astype(np_dtype))
    q = packed[:, :, 0]
    k, v = (cupy.asarray((random_array(np, (2, 90, 2, 128), np.float64, seed) / 4).astype(np_dtype))
            for seed in (8, 9))
    maps = [_map(x, 64) for x in (q, k, v)]
    for b, h, hk, q0, k0 in ((0, 0, 0, 0, 0), (1, 3, 1, 64, 0), (1, 2, 1, 0, 64)):
        s = cupy.full((64, 64), np.nan, cupy.float32)
        o = cupy.full((64, 128), np.nan, cupy.float32)
        kernel((1,), (128,), (*maps, s, o, np.int32(q0), np.int32(k0), np.int32(b), np.int32(h),
                              np.int32(hk)), shared_mem=smem)
        # Rows past the sequences come in as zeros.
        qa, ka, va = np.zeros((64, 128)), np.zeros((64, 128)), np.zeros((64, 128))
        for dst, src in ((qa, q[b, q0:q0 + 64, h]), (ka, k[b, k0:k0 + 64, hk]),
                         (va, v[b, k0:k0 + 64, hk])):
            dst[:len(src)] = cupy.asnumpy(src).astype(np.float64)
        got_s, got_o = cupy.asnumpy(s), cupy.asnumpy(o)
        assert not np.isnan(got_s).any() and not np.isnan(got_o).any(), "an element was not written"
        expected = qa @ ka.T
        np.testing.assert_allclose(got_s, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        # P as the kernel rounded it: O is then exact but for fp32 accumulation.
        expected = got_s.astype(np_dtype).astype(np.float64) @ va
        np.testing.assert_allclose(got_o, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def _end_aligned_cases():
    """Causal d = 64 shapes drawn with a fixed seed for the three-consumer forward, whose
    192-row tiles start `lead` rows before row 0: each lead (0, 64, 128) with seqlen_k below,
    at and above seqlen_q, GQA and MQA."""
    rng = np.random.default_rng(20261129)
    cases = []
    for lead in (0, 64, 128):
        for side in (-1, 0, 1):
            tiles = int(rng.integers(1, 12))
            sq = tiles * 192 - lead - int(rng.integers(0, 64))   # (tiles * 192 - sq) // 64 * 64 == lead
            sk = max(1, sq + side * int(rng.integers(1, 300)))
            hk = int(rng.choice([1, 2, 4]))
            cases.append((int(rng.integers(1, 3)), sq, sk, hk * int(rng.choice([1, 3])), hk, 64, dict(causal=True)))
    return cases


SM90_CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, keywords
    (2, 256, 256, 4, 4, 128, {}),
    (1, 1000, 777, 6, 2, 128, {}),
    (2, 77, 1025, 4, 1, 128, dict(causal=True)),
    (1, 1025, 300, 3, 3, 128, dict(causal=True)),    # the first rows see no key
    (2, 513, 513, 2, 1, 120, dict(causal=True)),
    (1, 700, 900, 4, 2, 128, dict(window_size=(100, 30))),
    (1, 700, 900, 4, 2, 64, dict(window_size=(100, 30))),      # three consumers at d = 64
    (3, 1, 65, 2, 2, 128, {}),
    (2, 300, 257, 4, 2, 40, dict(causal=True)),      # bucket 64: a 64-column kernel, zeros past 40
    # Causal d = 64 (three consumers, 192-row tiles that end at the last row): tiles from 128
    # rows before row 0, whose rows there see keys (seqlen_k > seqlen_q); from 64 rows
    # before; from row 0.
    (2, 1000, 1100, 4, 2, 64, dict(causal=True)),
    (1, 2048, 2048, 2, 1, 64, dict(causal=True)),
    (1, 576, 500, 2, 2, 64, dict(causal=True)),
    (1, 257, 300, 2, 2, 64, {}),
    (1, 200, 333, 3, 1, 96, dict(causal=True)),      # bucket 96 in the 128-column kernel
    (2, 129, 200, 2, 2, 160, {}),
    (1, 300, 300, 2, 1, 200, dict(causal=True)),     # bucket 224 in the 256-column kernel
    (1, 130, 97, 2, 2, 256, {}),
    (1, 333, 300, 4, 2, 128, dict(softcap=5.0, causal=True)),
    (2, 300, 333, 4, 4, 64, dict(alibi=True)),
    (1, 260, 300, 2, 2, 128, dict(softcap=3.0, alibi=True, window_size=(64, 0))),
    # Above head dim 128 with settled maxima: softcap + ALiBi, a window, both.
    (1, 333, 300, 4, 2, 256, dict(softcap=3.0, alibi=True, causal=True)),
    (1, 400, 350, 2, 1, 192, dict(window_size=(100, 20))),
    (2, 260, 300, 2, 2, 256, dict(softcap=3.0, alibi=True, window_size=(64, 0))),
    (1, 300, 400, 4, 2, 128, dict(block_mask="sliding")),
    # More tiles than SMs: the persistent blocks take several each, Q's and the buffers'
    # phases running on across tiles.
    (3, 300, 257, 60, 20, 128, dict(causal=True)),
    (2, 257, 130, 120, 40, 64, {}),
    # Above head dim 128, more tiles than SMs: a block each in causal calls, else blocks that
    # take several, O staged in V's buffers, in tiles of four, five, one and two key blocks,
    # and under a window tiles whose rows see no key (O from the registers) before tiles of
    # one and two.
    (2, 300, 257, 70, 10, 256, {}),
    (1, 257, 300, 140, 140, 192, dict(softcap=3.0, alibi=True)),
    (1, 200, 60, 140, 35, 192, {}),
    (2, 130, 150, 70, 10, 256, dict(softcap=3.0)),
    (1, 300, 200, 70, 70, 256, dict(causal=True)),
    (1, 300, 100, 140, 35, 256, dict(window_size=(10, 0))),
    (2, 400, 700, 70, 10, 192, dict(window_size=(50, 20), softcap=3.0)),
] + _end_aligned_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", SM90_CASES,
                         ids=lambda c: "-".join(map(str, c[:6])) + "-" + "-".join(sorted(c[6])))
def test_sm90_forward_matches_the_reference(case, dtype):
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    import ml_dtypes
    b, sq, sk, h, hk, d, kw = case
    kw = dict(kw)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    packed = cupy.asarray(random_array(np, (b, sq, 3, h, d), np_dtype, sq + d))
    q = packed[:, :, 1]
    k, v = (cupy.asarray(random_array(np, (b, sk, hk, d), np_dtype, seed)) for seed in (sk, sk + 1))
    ref_kw = dict(window_size=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0))
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = cupy.asarray(np.linspace(0.05, 0.5, h), cupy.float32)
        ref_kw["alibi_slopes"] = kw["alibi_slopes"]
    mask = None
    if kw.pop("block_mask", None):
        mask = cf.masks.sliding_window(sq, sk, 1, block_size=128)
        kw["block_mask"] = mask
    spec = _spec.CallSpec.of(q, causal=kw.get("causal", False),
                             window_size=kw.get("window_size", (-1, -1)),
                             softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"),
                             block_mask=mask)
    assert _launch.kernel_family(spec, mask, q, k, v) == "sm90"
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    scale = d ** -0.5
    elem = None if mask is None else cupy.asarray(mask.to_dense())
    causal = kw.get("causal", False)
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal, elem, **ref_kw)
    naive_out, naive_lse = attention_naive(q, k, v, scale, causal, dtype, elem, **ref_kw)
    assert_rule("out", out, ref_out, naive_out, 2)
    assert_rule("lse", lse, ref_lse, naive_lse, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sm90_forward_with_climbing_maxima(dtype):
    """Scores that climb along the keys, so that a row's max moves block after block: rows
    with a small slope stay within the settled base's slack of it (p up to 2^8), rows with a
    steep one move past it at every block, and in the steepest the last key dominates the row
    (a weight that rounds to exactly 1, as the naive softmax gives it). Under FlashAttention's
    rule like any input (softmax.cuh, OnlineSoftmax::new_max)."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    import ml_dtypes
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    b, sq, sk, h, d = 1, 200, 1000, 2, 128
    rng = np.random.default_rng(7)
    # Row i's scores rise by slope_i (log2 units) per 128-key block: 0.05 .. 40 over the rows;
    # the last key lies one more block's rise up.
    slope = np.geomspace(0.05, 40.0, sq)
    ramp = np.arange(sk) / 128.0
    q = np.zeros((b, sq, h, d))
    q[..., 0] = (slope / np.log2(np.e) * np.sqrt(d))[None, :, None]
    q[..., 1:] = 0.3 * rng.standard_normal((b, sq, h, d - 1))
    k = np.zeros((b, sk, h, d))
    k[..., 0] = ramp[None, :, None]
    k[:, -1, :, 0] += 1.0   # the last key one block's rise above the ramp
    k[..., 1:] = 0.3 * rng.standard_normal((b, sk, h, d - 1))
    q, k = (cupy.asarray(x.astype(np_dtype)) for x in (q, k))
    v = cupy.asarray(random_array(np, (b, sk, h, d), np_dtype, 8))
    out, lse = cf.flash_attention(q, k, v, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, d ** -0.5, False)
    naive_out, naive_lse = attention_naive(q, k, v, d ** -0.5, False, dtype)
    assert_rule("out", out, ref_out, naive_out, 2)
    assert_rule("lse", lse, ref_lse, naive_lse, 2)
    # The steep rows are the last key's: the naive softmax rounds its weight to 1, and their
    # error is their own (the whole tensor's bound would hide it under the other rows').
    one_key = (cupy.asarray(naive_out)[0] == v[0, -1].astype(cupy.float32)[None]).all(axis=(1, 2))
    assert int(one_key.sum()) >= 20
    assert_rule("out of the rows one key dominates", out[:, one_key], ref_out[:, one_key],
                naive_out[:, one_key], 2)


@pytest.mark.gpu
@pytest.mark.parametrize("spelling", ["alibi_slopes", "score_mod"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("sq, sk, d, causal", [
    (700, 1000, 128, False), (700, 1000, 128, True), (1000, 300, 128, False), (1000, 300, 64, True),
    (333, 900, 256, False), (333, 900, 256, True), (900, 333, 64, False)])
def test_sm90_forward_alibi_from_the_diagonal(sq, sk, d, causal, dtype, spelling):
    """ALiBi tiles visit the key block of their middle row's diagonal first, then the later
    blocks, then the earlier ones backwards, with settled maxima: slopes from gentle to steep
    (a row's max then climbs by up to 8 x 128 per block toward its diagonal), diagonals inside,
    before and after the keys (seqlen_q above and below seqlen_k). The same rule spelled as a
    user score_mod takes that order with exact maxima above head dim 64 (key order at 64)."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    import ml_dtypes
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    b, h = 2, 4
    q, k, v = (cupy.asarray(random_array(np, (b, s, h, d), np_dtype, seed))
               for s, seed in ((sq, 1), (sk, 2), (sk, 3)))
    slopes = cupy.asarray(np.geomspace(0.01, 8.0, b * h).reshape(b, h), cupy.float32)
    rule = dict(alibi_slopes=slopes) if spelling == "alibi_slopes" else dict(score_mod=cf.ScoreMod(
        f"score - slopes(b, h) * fabsf((float)(q_idx + {sk - sq} - kv_idx))", arrays={"slopes": slopes}))
    spec = _spec.CallSpec.of(q, causal=causal, **rule)
    assert _launch.kernel_family(spec, None, q, k, v) == "sm90"
    out, lse = cf.flash_attention(q, k, v, causal=causal, return_lse=True, **rule)
    ref_out, ref_lse = attention_ref(q, k, v, d ** -0.5, causal, alibi_slopes=slopes)
    naive_out, naive_lse = attention_naive(q, k, v, d ** -0.5, causal, dtype, alibi_slopes=slopes)
    assert_rule("out", out, ref_out, naive_out, 2)
    assert_rule("lse", lse, ref_lse, naive_lse, 2)


def test_hopper_forward_shared_memory_fits_sm90():
    """Every Hopper forward instantiation's shared memory (two Q buffers and O's stage in the
    persistent kernels, which puts d=128 within 2 KB of the limit) fits sm_90's opt-in limit
    with room for the kernel's static barriers."""
    names = _launch.kernel_names(_config.SMEM_LIMIT[90], hopper=True)["fwd_sm90.cu"]
    assert names
    for name in names:
        hd, groups, keys = (int(x) for x in re.fullmatch(r"flash_fwd_sm90_kernel<\w+, (\d+), .*>, (\d+), (\d+)>",
                                                          name).groups())
        assert _launch.sm90_fwd_smem(hd, groups, keys) + 1024 <= _config.SMEM_LIMIT[90], name


@pytest.mark.parametrize("d, kw, groups", [
    (64, {}, 3), (40, dict(causal=True, alibi=True), 3), (64, dict(softcap=2.0), 2),
    (64, dict(softcap=2.0, alibi=True), 3), (64, dict(causal=True, softcap=2.0, alibi=True), 3),
    (64, dict(causal=True, softcap=2.0, alibi=True, seq=_spec.SEQ_PACKED), 2),
    (64, dict(block_mask=True), 2), (64, dict(score_mod=True), 3), (128, {}, 2), (256, {}, 2)])
def test_hopper_forward_takes_three_consumers_at_d64(d, kw, groups):
    """192-row tiles (three consumer warpgroups) at head dim 64, except where a block mask's
    128-row blocks need the two-consumer kernel, softcap alone runs faster on it and softcap
    with ALiBi in packed batches spilled on three (a user score_mod's: checked at the call,
    below)."""
    kw = dict(kw)
    mask = cf.masks.causal(256, 256) if kw.pop("block_mask", False) else None
    q = np.zeros((1, 256, 2, d), np.float16)
    alibi = np.ones(2, np.float32) if kw.pop("alibi", False) else None
    score_mod = cf.ScoreMod("score") if kw.pop("score_mod", False) else None
    spec = _spec.CallSpec.of(q, causal=kw.pop("causal", False), alibi_slopes=alibi, block_mask=mask,
                             score_mod=score_mod, **kw)
    assert _launch.sm90_fwd_groups(spec, mask) == groups


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rule, groups", [
    ("score - slopes[h] * fabsf((float)(q_idx - kv_idx))", 3), ("score - 0.5f", 3),
    ("score + bias[bias.offset(h, kv_idx - q_idx + 512)]", 2),
    ("score + rel(min(max(q_idx - kv_idx, -64), 64) + 64, h)", 2)],
    ids=["alibi", "constant", "table", "clamped-table"])
def test_user_score_mod_at_d64_and_256_takes_the_larger_tile_where_it_reads_no_table(rule, groups, causal):
    """A user score_mod at head dim 64 runs on three consumers, and at 256 on 80-key blocks,
    where it reads no memory per score and that kernel compiles without local memory; a table
    lookup per score takes two consumers and 64 keys (the first also spills with three)."""
    import cupy
    from cupyflash import mods
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    arrays = {"slopes": np.zeros(4, np.float32), "bias": np.zeros((4, 1024), np.float32),
              "rel": np.zeros((129, 4), np.float32)}
    sm = cf.ScoreMod(rule, arrays={n: a for n, a in arrays.items() if n in rule})
    for d, tile in ((64, (groups, 128)), (256, (2, 80 if groups == 3 else 64))):
        q = np.zeros((1, 256, 4, d), np.float16)
        spec = _spec.CallSpec.of(q, causal=causal, score_mod=sm, user_mods=mods.prelude(sm, None))
        assert _launch.sm90_fwd_call_tile(spec, None) == tile


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["dropout", "mask64", "unaligned", "forced"])
def test_what_the_hopper_forward_does_not_cover_runs_the_generic_kernels(what, monkeypatch):
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    d = 36 if what == "unaligned" else 64      # 72-byte rows are not 16-byte multiples
    q, k, v = (cupy.asarray(random_array(np, (1, 130, 2, d), np.float16, s)) for s in (1, 2, 3))
    kw = dict(dropout_p=0.1) if what == "dropout" else {}
    mask = cf.masks.sliding_window(130, 130, 1, block_size=64) if what == "mask64" else None
    if what == "forced":
        monkeypatch.setenv("CUPYFLASH_KERNELS", "generic")
    spec = _spec.CallSpec.of(q, causal=False, block_mask=mask, **kw)
    assert _launch.kernel_family(spec, mask, q, k, v) == "generic"


# The Hopper backward (cuda/bwd_sm90.cu) covers every head-dim bucket: its 64- and 128-column
# kernels and, above 128, the 256-column one, dQ added for the bucket's columns only (32 of 64
# at d = 24, 96 of 128, 160 and 224 of 256).
# At d = 64 a step takes 128 queries (the dS^T tiles' two query halves, dQ split by queries).
SM90_BWD_CASES = SM90_CASES + [
    (2, 150, 170, 4, 2, 24, dict(causal=True)),
    (2, 200, 129, 4, 2, 256, dict(causal=True, softcap=4.0)),
    (1, 400, 300, 4, 2, 64, dict(block_mask="sliding")),
    (1, 260, 300, 2, 2, 64, dict(softcap=3.0, window_size=(64, 0))),
    # 80-query steps (no band): the last step's 16-row blocks past seqlen_q not added, bucket
    # 96's columns (half of the second warpgroup's) clipped, one whole step, modifiers.
    (1, 250, 300, 4, 2, 96, {}),
    (1, 80, 200, 3, 1, 128, dict(alibi=True)),
    (2, 161, 129, 2, 2, 120, dict(softcap=5.0, alibi=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", SM90_BWD_CASES,
                         ids=lambda c: "-".join(map(str, c[:6])) + "-" + "-".join(sorted(c[6])))
def test_sm90_backward_matches_the_reference(case, dtype, request):
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    import gpu_checks
    b, sq, sk, h, hk, d, kw = case
    kw = dict(kw)
    checked = gpu_checks.Case(dtype, sq, sk, d, kw.get("causal", False), batch=b, nheads=h, nheads_k=hk)
    q, k, v, dout = gpu_checks.make_inputs(checked, gpu_checks.seed_of(request))
    variant = {}
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = variant["alibi_slopes"] = cupy.asarray(np.linspace(0.05, 0.5, h), cupy.float32)
    for name in ("window_size", "softcap"):
        if name in kw:
            variant[name] = kw[name]
    mask = elem = None
    if kw.pop("block_mask", None):
        kw["block_mask"] = mask = cf.masks.sliding_window(sq, sk, 1, block_size=128)
        elem = cupy.asarray(mask.to_dense())
    spec = _spec.CallSpec.of(q, causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                             softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"),
                             block_mask=mask)
    assert _launch.bwd_family(spec, mask, q, k, v, dout) == "sm90"
    scale = d ** -0.5
    out, lse = cf.flash_attention(q, k, v, softmax_scale=scale, return_lse=True, **kw)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, softmax_scale=scale, **kw)
    gpu_checks.check_backward(checked, dout, q, k, v, grads, scale, elem, out=out, lse=lse, **variant)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    (2, 250, 300, 4, 2, 128, {}), (1, 300, 250, 2, 2, 96, dict(softcap=5.0)),
    (1, 161, 161, 3, 1, 120, dict(alibi=True)), (2, 400, 90, 2, 1, 128, dict(softcap=4.0, alibi=True))],
    ids=lambda c: "-".join(map(str, c[:6])) + "-" + "-".join(sorted(c[6])))
def test_sm90_causal_backward_in_80_query_steps(case, dtype, request, monkeypatch):
    """The causal backward's 80-query steps (long calls only: SM90_BWD_CAUSAL_80_FROM) at
    short lengths, the threshold lowered: steps that start below the diagonal and end past
    seqlen_q (odd tails both ways, GQA, rows without keys, softcap, ALiBi)."""
    monkeypatch.setattr(_launch, "SM90_BWD_CAUSAL_80_FROM", 1)
    b, sq, sk, h, hk, d, kw = case
    spec = _spec.CallSpec.of(np.zeros((1, sq, h, d), np.float16), causal=True, softcap=kw.get("softcap", 0.0),
                             alibi_slopes=np.ones(h) if kw.get("alibi") else None)
    assert _launch.sm90_bwd_rows(_launch.sm90_bwd_headdim(d), spec, seqlen_q=sq) == 80
    test_sm90_backward_matches_the_reference((b, sq, sk, h, hk, d, dict(kw, causal=True)), dtype, request)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    (2, 250, 300, 4, 2, 128, dict(window_size=(100, 0))),
    (1, 300, 250, 2, 2, 96, dict(window_size=(37, 61), softcap=5.0)),
    (1, 161, 400, 3, 1, 120, dict(window_size=(-1, 45), alibi=True)),
    (2, 400, 90, 2, 1, 128, dict(window_size=(150, -1), softcap=4.0, alibi=True))],
    ids=lambda c: "-".join(map(str, c[:6])) + "-" + "-".join(sorted(c[6])))
def test_sm90_window_backward_in_80_query_steps(case, dtype, request, monkeypatch):
    """The windowed backward's 80-query steps (wide bands and long calls only:
    SM90_BWD_LOCAL_80_FROM, SM90_BWD_CAUSAL_80_FROM where a side is open) on narrow ones, the
    thresholds lowered: steps that start before a key block's band and end past it or past
    seqlen_q, each side open or closed, odd tails both ways, GQA, ALiBi, softcap."""
    monkeypatch.setattr(_launch, "SM90_BWD_LOCAL_80_FROM", 1)
    monkeypatch.setattr(_launch, "SM90_BWD_CAUSAL_80_FROM", 1)
    b, sq, sk, h, hk, d, kw = case
    spec = _spec.CallSpec.of(np.zeros((1, sq, h, d), np.float16), causal=False, window_size=kw["window_size"],
                             softcap=kw.get("softcap", 0.0), alibi_slopes=np.ones(h) if kw.get("alibi") else None)
    assert spec.local and _launch.sm90_bwd_rows(_launch.sm90_bwd_headdim(d), spec, seqlen_q=sq) == 80
    test_sm90_backward_matches_the_reference(case, dtype, request)


@pytest.mark.gpu
@pytest.mark.parametrize("d, family", [(64, "generic"), (128, "sm90")])
def test_hopper_backward_takes_block_masks_its_steps_divide(d, family):
    """A step of the Hopper backward is 128 queries x 128 keys at d = 64, 64 queries above: a
    BlockMask of 64-query blocks runs the generic backward at d = 64 only."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    q, k, v = (cupy.asarray(random_array(np, (1, 256, 2, d), np.float16, s)) for s in (1, 2, 3))
    mask = cf.masks.sliding_window(256, 256, 1, block_size=(64, 128))
    spec = _spec.CallSpec.of(q, causal=False, block_mask=mask)
    assert _launch.bwd_family(spec, mask, q, k, v) == family


@pytest.mark.parametrize("d, kw, rows", [
    (128, {}, 80), (96, dict(softcap=5.0, alibi_slopes=np.ones(2)), 80), (64, {}, 128), (256, {}, 64),
    (128, dict(causal=True), 64), (128, dict(window_size=(100, 0)), 64), (128, dict(block_mask=True), 64),
    (128, dict(deterministic=True), 64), (128, dict(score_mod=True), 80),
    (128, dict(alibi_slopes=np.ones(2), seq=_spec.SEQ_PACKED), 80), (128, dict(seq=_spec.SEQ_PACKED), 80),
    (128, dict(alibi_slopes=np.ones(2), causal=True, seqlen_q=8192), 80),
    (128, dict(alibi_slopes=np.ones(2), causal=True, seqlen_q=8191), 64),
    (128, dict(causal=True, seqlen_q=8192), 80), (96, dict(causal=True, softcap=5.0, seqlen_q=9000), 80),
    (128, dict(causal=True, seqlen_q=8191), 64), (128, dict(causal=True, seqlen_q=8192, seq=_spec.SEQ_PACKED), 64),
    (128, dict(window_size=(100, 0), seqlen_q=8192), 64), (128, dict(window_size=(2047, 0), seqlen_q=8192), 80),
    (96, dict(window_size=(1024, 1023), alibi_slopes=np.ones(2), seqlen_q=4096), 80),
    (128, dict(window_size=(1024, 1022), seqlen_q=4096), 64), (128, dict(window_size=(4096, 0), seqlen_q=2047), 64),
    (128, dict(window_size=(4096, 0), seqlen_q=8192, seq=_spec.SEQ_PACKED), 64),
    (128, dict(window_size=(4096, 0), seqlen_q=8192, block_mask=True), 64),
    (128, dict(window_size=(-1, 100), seqlen_q=8192), 80), (128, dict(window_size=(100, -1), seqlen_q=8191), 64)])
def test_the_hopper_backward_steps_80_queries_at_d128_without_a_band(d, kw, rows):
    """m64n80 products where nothing else needs the registers or 64-row steps (a band's
    diagonal blocks, a block mask's lists, the deterministic counters), causal calls from SM90_BWD_CAUSAL_80_FROM query rows on (``seqlen_q``;
    shorter ones lose more to the masked rows of steps that do not start on the diagonal), and
    windows whose band spans SM90_BWD_LOCAL_80_FROM rows (both sides closed) or whose calls are
    as long as causal ones (a side open)."""
    seqlen_q = kw.pop("seqlen_q", 256)
    q = np.zeros((1, 256, 2, d), np.float16)
    mask = cf.masks.sliding_window(256, 256, 1, block_size=128) if kw.pop("block_mask", False) else None
    deterministic = kw.pop("deterministic", False)
    score_mod = object() if kw.pop("score_mod", False) else None   # any: the spec asks only whether
    spec = _spec.CallSpec.of(q, causal=kw.pop("causal", False), block_mask=mask, score_mod=score_mod, **kw)
    hd = _launch.sm90_bwd_headdim(spec.headdim)
    assert _launch.sm90_bwd_rows(hd, spec, mask, deterministic, seqlen_q) == rows


@pytest.mark.parametrize("pair_mib, pairs, group", [
    (0.5, 256, 64), (1, 128, 32), (2, 64, 16), (3, 64, 16), (16, 8, 2), (100, 8, 1), (1, 8, 8), (0, 128, 66)])
def test_causal_launch_groups_of_the_hopper_passes_fit_in_l2(pair_mib, pairs, group, monkeypatch):
    """The Hopper passes group (head, batch) pairs by the bytes all tiles of a pair read: the
    most pairs, a power of two, whose bytes fit the L2 (here 50 MiB), at most all of them;
    without those bytes (the generic kernels) a group's 16-tile pairs fill 132 SMs 8 times."""
    attrs = {"L2CacheSize": 50 << 20, "MultiProcessorCount": 132}
    monkeypatch.setattr(_launch, "_device_attribute", attrs.__getitem__)
    assert _launch._launch_group(pairs, 16, int(pair_mib * 2**20)) == group


@pytest.mark.parametrize("d, group", [(64, 64), (128, 32), (192, 16), (256, 8)])
def test_causal_forward_groups_fill_half_the_l2_above_head_dim_128(d, group, monkeypatch):
    """The Hopper forward's groups at 2K keys (bf16 K and V, 50 MiB of L2): the pairs whose K and
    V fit the L2 where the kernel is persistent (head dim <= 128), half of it above (a block per
    tile: measured faster there)."""
    attrs = {"L2CacheSize": 50 << 20, "MultiProcessorCount": 132}
    monkeypatch.setattr(_launch, "_device_attribute", attrs.__getitem__)
    pair_bytes = 2048 * 2 * d * 2
    assert _launch._launch_group(256, 16, pair_bytes, _launch.sm90_fwd_l2_part(_launch.sm90_headdim(d))) == group


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("how", ["slopes", "table"])
def test_sm90_backward_of_a_user_score_mod_takes_80_rows_where_its_kernel_allows(how, dtype, request):
    """ALiBi written as a user score_mod two ways (a slope per head; a table of biases per
    distance, whose lookup leaves the 80-row kernel short of registers with NVRTC 13): the
    call takes 80-query steps where that kernel has no local memory and ptxas kept its wgmma
    asynchronous (a compile of its own and its verbose log say which), else 64, and
    matches the float64 reference with built-in ALiBi either way."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    import gpu_checks
    from cupyflash import api
    b, sq, sk, h, hk, d = 2, 161, 203, 4, 2, 128
    checked = gpu_checks.Case(dtype, sq, sk, d, False, batch=b, nheads=h, nheads_k=hk)
    q, k, v, dout = gpu_checks.make_inputs(checked, gpu_checks.seed_of(request))
    slopes = cupy.asarray(np.linspace(0.05, 0.5, h), cupy.float32)
    dist = f"(q_idx + {sk - sq} - kv_idx)"   # ALiBi's, aligned at the last row and key
    if how == "slopes":
        mod = cf.ScoreMod(f"score - slopes[h] * fabsf((float){dist})", grad="dscore", arrays={"slopes": slopes})
    else:
        w = sq + sk
        table = -cupy.abs(cupy.arange(-w, w + 1, dtype=cupy.float32))[:, None] * slopes
        mod = cf.ScoreMod(f"score + table({dist} + {w}, h)", grad="dscore", arrays={"table": table})
    spec, _ = api._call_spec(q, k, False, None, (-1, -1), 0.0, None, 0.0, None, mod,
                             api._user_mods(mod, None, None, cupy))
    name, code = _launch._bwd_sm90_name(spec, 128, 80), _compile.source("bwd_sm90.cu", spec.user_mods)
    log, lowered, cubin = _compile.nvrtc_run(code, "bwd_sm90.cu", [name], "sm_90a", _compile.ptxas_log_options())
    from cupy_backends.cuda.api import driver
    module = cupy.cuda.function.Module()
    module.load(cubin)
    local = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, module.get_function(lowered[name]).ptr)
    clean = not local and _compile.WGMMA_SERIALIZED not in log
    rows = _launch.sm90_bwd_step(spec, None, False, sq)
    assert rows == (80 if clean else 64)
    assert how == "table" or rows == 80, "the slope per head's kernel no longer fits 80 rows"
    scale = d ** -0.5
    out, lse = cf.flash_attention(q, k, v, softmax_scale=scale, score_mod=mod, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, softmax_scale=scale, score_mod=mod)
    gpu_checks.check_backward(checked, dout, q, k, v, grads, scale, out=out, lse=lse, alibi_slopes=slopes)


@pytest.mark.parametrize("d, kw, overlaps", [
    (128, {}, True), (96, {}, True), (256, {}, True), (200, dict(softcap=5.0), True),
    (64, {}, False), (40, {}, False), (128, dict(causal=True), False),
    (256, dict(window_size=(100, 0)), True), (64, dict(window_size=(100, 0)), False),
    (128, dict(window_size=(-1, 0)), False), (128, dict(block_mask="random"), True),
    (128, dict(block_mask="window"), True), (128, dict(block_mask="causal"), False),
    (128, dict(block_mask="window", causal=True), False)])
def test_the_dq_convert_overlaps_the_pass_unless_causal_from_head_dim_128(d, kw, overlaps):
    """The Hopper kernels' buckets: 96 runs the 128 kernel, 200 the 256 one; a causal band (a
    causal block mask's and window (-1, 0) included) keeps the convert after the pass, a
    window or a block mask does not."""
    q = np.zeros((1, 256, 2, d), np.float16)
    masks = {"random": lambda: cf.masks.random(256, 256, 0.5, 0, block_size=128),
             "window": lambda: cf.masks.sliding_window(256, 256, 1, block_size=128),
             "causal": lambda: cf.masks.causal(256, 256, block_size=128)}
    kind = kw.pop("block_mask", None)
    mask = masks[kind]() if kind else None
    # As the api does: a causal block mask makes the call causal.
    causal = kw.pop("causal", False) or (mask is not None and mask.causal)
    spec = _spec.CallSpec.of(q, causal=causal, block_mask=mask, **kw)
    assert _launch.convert_overlaps(spec, mask) == overlaps


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    (1, 1024, 1024, 2, 2, 96, dict(window_size=(100, 50))), (1, 97, 150, 6, 2, 96, dict(window_size=(5, 0))),
    (2, 300, 257, 4, 2, 128, {}), (1, 300, 333, 2, 1, 256, dict(causal=True)), (1, 200, 130, 4, 2, 64, {}),
    # Few pass blocks over many rows: the preprocess (a block per 64 rows of a head) runs
    # waves, and the last kv head's count is zeroed in its last one, when the pass and the
    # convert may already be there.
    (1, 4096, 128, 32, 4, 128, {}),
    # The preprocess beside the pass (_launch.preprocess_beside) over many units: the pass's
    # first blocks wait for its flags.
    (1, 2048, 2048, 16, 4, 128, dict(causal=True)), (2, 1500, 700, 8, 2, 96, dict(window_size=(300, 0)))],
    ids=lambda c: "-".join(map(str, c[:6])) + "-" + "-".join(sorted(c[6])))
def test_the_backward_kernels_wait_for_the_ones_before_them(case, dtype, request, monkeypatch):
    """The preprocess, the dK/dV pass and the convert run as programmatic dependent launches
    (each may start before the one before has finished). The buffers the call leaves
    uninitialized for them are poisoned first, the fp32 dQ buffer with NaN and the counts of
    finished pass blocks with 2^30, so that a kernel that reads one before the kernel that
    writes it is done gives NaN or a wrong dq rather than last call's values. Calls with the
    convert beside the pass (head dims above 64 without a causal band) and after it, and with
    the preprocess beside the pass, whose flags (zeroed, with the counts) the pass and the
    convert wait for: there the poisoned dQ buffer checks those waits."""
    real_empty, real_dq_buffer = _launch.empty, _launch.dq_buffer
    kinds = []

    def poisoned(a):
        if a is not None:
            a.fill(2**30 if a.dtype.kind == "i" else np.nan)
            kinds.append(a.dtype.kind)
        return a

    monkeypatch.setattr(_launch, "empty", lambda shape, dtype_: poisoned(real_empty(shape, dtype_)))
    monkeypatch.setattr(_launch, "dq_buffer", lambda *a, **kw: poisoned(real_dq_buffer(*a, **kw)))
    monkeypatch.setenv("CUPYFLASH_LAUNCH_PLANS", "0")   # every call prepared, and poisoned, afresh
    for _ in range(3):
        test_sm90_backward_matches_the_reference(case, dtype, request)
    b, sq, _, h, _, d, kw = case
    spec = _spec.CallSpec.of(np.zeros((b, sq, h, d), np.float16), causal=kw.get("causal", False),
                             window_size=kw.get("window_size", (-1, -1)))
    beside = _launch.preprocess_beside(spec, _launch.sm90_bwd_step(spec, None, False, sq))
    counted = _launch.convert_overlaps(spec, None) and not beside
    assert kinds.count("f") == 3 and kinds.count("i") == (3 if counted else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(block_mask=True), dict(deterministic=True)],
                         ids=["dense", "causal", "block_mask", "deterministic"])
def test_the_hopper_backward_runs_as_a_chain_of_dependent_launches(kw, monkeypatch):
    """README (Hopper kernels): the preprocess (or the one beside the pass), the dK/dV pass and
    the convert are queued one right after another, the pass and the convert each as the
    programmatic dependent of the kernel before it; the buffers the pass needs (the
    preprocess's flags, the deterministic counters, the block mask's lists) are made before the
    preprocess, so nothing is queued between the two."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    kw = dict(kw)
    q, k, v, dout = (cupy.asarray(random_array(np, (1, 300, 4, 128), np.float16, i)) for i in range(4))
    if kw.pop("block_mask", False):
        kw["block_mask"] = cf.masks.random(300, 300, 0.5, 0, block_size=128)
    deterministic = kw.pop("deterministic", False)
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    monkeypatch.setenv("CUPYFLASH_LAUNCH_PLANS", "0")   # every step through _launch and _allocate
    steps = []
    real_launch, real_allocate = _launch._launch, _launch._allocate
    monkeypatch.setattr(_launch, "_launch", lambda filename, name, *a, dependent=False, **k: (
        steps.append((name.split("<")[0], dependent)), real_launch(filename, name, *a, dependent=dependent, **k))[1])
    monkeypatch.setattr(_launch, "_allocate", lambda *a: (steps.append(("allocate", None)), real_allocate(*a))[1])
    cf.flash_attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kw)
    at = next(i for i, (name, _) in enumerate(steps) if name.startswith("bwd_preprocess"))
    assert steps[at][1] is False
    assert steps[at + 1:] == [("flash_bwd_sm90_kernel", True), ("bwd_convert_dq_kernel", True)]


# deterministic=True on the Hopper backward: dense and causal calls, every head-dim kernel,
# GQA, more key blocks than one (their order is what is fixed) and tails.
SM90_DETERMINISTIC_CASES = [
    (2, 300, 700, 4, 2, 64, dict(causal=True)),
    (1, 513, 1025, 4, 1, 96, {}),
    (2, 257, 640, 2, 2, 128, dict(causal=True, softcap=5.0)),
    (1, 300, 333, 2, 1, 256, dict(causal=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_DETERMINISTIC_CASES,
                         ids=lambda c: "-".join(map(str, c[:6])) + "-" + "-".join(sorted(c[6])))
def test_sm90_deterministic_backward_repeats_bit_for_bit(case, request):
    """Key blocks add dQ in key order: two runs give the same bits, and the reference's
    values; a window or a block mask runs the generic deterministic pass instead."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    import gpu_checks
    b, sq, sk, h, hk, d, kw = case
    checked = gpu_checks.Case("bf16", sq, sk, d, kw.get("causal", False), batch=b, nheads=h, nheads_k=hk)
    q, k, v, dout = gpu_checks.make_inputs(checked, gpu_checks.seed_of(request))
    spec = _spec.CallSpec.of(q, causal=kw.get("causal", False), softcap=kw.get("softcap", 0.0))
    assert _launch.bwd_family(spec, None, q, k, v, dout, deterministic=True) == "sm90"
    windowed = _spec.CallSpec.of(q, causal=False, window_size=(64, 0))
    assert _launch.bwd_family(windowed, None, q, k, v, dout, deterministic=True) == "generic"
    scale = d ** -0.5
    out, lse = cf.flash_attention(q, k, v, softmax_scale=scale, return_lse=True, **kw)
    runs = [cf.flash_attention_backward(dout, q, k, v, out, lse, softmax_scale=scale,
                                        deterministic=True, **kw) for _ in range(3)]
    gpu_checks.assert_bit_identical_grads(runs[0], runs[1])
    gpu_checks.assert_bit_identical_grads(runs[0], runs[2])
    variant = {"softcap": kw["softcap"]} if "softcap" in kw else {}
    gpu_checks.check_backward(checked, dout, q, k, v, runs[0], scale, out=out, lse=lse, **variant)
