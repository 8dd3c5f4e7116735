"""Parameter packing and kernel launches (CuPy arrays only; validation is done before).

``FWD_PARAMS`` and ``BWD_PARAMS`` mirror ``FwdParams`` / ``BwdParams`` of cuda/params.cuh
field for field (aligned NumPy dtypes: the C layout rules). Every launch goes to CuPy's
current stream; nothing here synchronizes.
"""
import collections
import contextlib
import dataclasses
import functools
import math
import os
import threading
from typing import NamedTuple

import numpy as np

from . import _arrays, _compile, _config, _driver, _spec, _tma, mods
from ._compile import get_kernel, template_name


_TENSOR = [("ptr", np.uint64), ("batch_stride", np.int64), ("row_stride", np.int64),
           ("head_stride", np.int64)]
TENSOR_REF = np.dtype(_TENSOR, align=True)
BLOCK_LIST = np.dtype([("idx", np.uint64), ("count", np.uint64), ("partial", np.uint64),
                       ("width", np.int32), ("rows", np.int32), ("heads", np.int32),
                       ("row_tile", np.int32), ("list_tile", np.int32)], align=True)
SCORE_PARAMS = np.dtype([("softcap", np.float64), ("softcap_in", np.float32),
                         ("softcap_log2", np.float32), ("alibi", np.uint64),
                         ("alibi_stride", np.int32), ("alibi_unit", np.float32),
                         ("scale", np.float32), ("bounded", np.int32)], align=True)
# The widest softcap * log2(e) whose bf16 calls may run the softmax with a fixed base
# (bounded_scores).
BOUNDED_LOG2 = 64.0
# cuda/params.cuh's UserParams: arrays per call and dimensions per array.
USER_ARRAYS, USER_NDIM = 8, 4
USER_PARAMS = np.dtype([("arrays", np.uint64, (USER_ARRAYS,)), ("grads", np.uint64, (USER_ARRAYS,)),
                        ("shape", np.int32, (USER_ARRAYS, USER_NDIM))], align=True)
DROPOUT_PARAMS = np.dtype([("seed", np.uint64), ("offset", np.uint32), ("threshold", np.uint32),
                           ("scale", np.float64)], align=True)
_DIMS = [("batch", np.int32), ("nheads", np.int32), ("nheads_k", np.int32), ("group", np.int32),
         ("seqlen_q", np.int32), ("seqlen_k", np.int32), ("headdim", np.int32),
         ("vec_ok", np.int32), ("launch_group", np.int32), ("scale", np.float64), ("scale_log2", np.float32),
         ("window_left", np.int32), ("window_right", np.int32), ("mod", SCORE_PARAMS), ("drop", DROPOUT_PARAMS)]
VARLEN_PARAMS = np.dtype([("cu_seqlens_q", np.uint64), ("cu_seqlens_k", np.uint64), ("total_q", np.int32)],
                         align=True)
CACHE_PARAMS = np.dtype([("seqlens", np.uint64), ("block_table", np.uint64), ("new_keys", np.int32),
                         ("page_size", np.int32), ("pages_per_seq", np.int32)], align=True)
FWD_PARAMS = np.dtype([(n, TENSOR_REF) for n in ("q", "k", "v", "o")]
                      + [("lse", np.uint64)] + _DIMS
                      + [("kv_blocks", BLOCK_LIST), ("user", USER_PARAMS), ("varlen", VARLEN_PARAMS),
                         ("cache", CACHE_PARAMS)], align=True)
BWD_PARAMS = np.dtype([(n, TENSOR_REF) for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")]
                      + [("lse", np.uint64), ("dsum", np.uint64), ("lse_log2", np.uint64), ("dq_accum", np.uint64),
                         ("dq_accum_rows", np.int32), ("dq_accum_cols", np.int32)]
                      + _DIMS + [("kv_blocks", BLOCK_LIST), ("q_blocks", BLOCK_LIST),
                                 ("user", USER_PARAMS), ("varlen", VARLEN_PARAMS)], align=True)
# cuda/seqinfo.cuh's ACCUM_ALIGN: packed sequences' slices of the fp32 dQ buffer start at
# multiples of it (varlen_dq_accum_rows).
VARLEN_ACCUM_ALIGN = 128

# Causal passes of the generic kernels: tiles per launch group, in multiples of the SM count
# (see _launch_group). With 8, a simulation of greedy block scheduling (tile lengths of causal
# attention, 132 SMs, seqlen 512-16K) loses at most 1.5% to the best order, where one (head,
# batch) pair per group loses up to 7%; on the H100 it beat 1, 2 and 4 waves and one group of
# all pairs (which lost up to 9% at seqlen 1K-2K: each head's K and V were read from memory
# once per tile).
LAUNCH_GROUP_WAVES = 8

# Threads of bwd_convert_dq_kernel (up to its launch bound, 256: its loops stride by blockDim).
DQ_CONVERT_THREADS = 256
# cuda/bwd.cu's DqLayout, the fp32 dQ buffer's order: the generic passes' (tiles in mma order),
# the Hopper pass's (lane-major tiles), its 80-query kernel's (column strips).
DQ_MMA, DQ_LANES, DQ_STRIPS = 0, 1, 2
# cuda/bwd.cu's bwd_preprocess_kernel: rows and threads per block.
PREPROCESS_ROWS, PREPROCESS_THREADS = 64, 256
# cuda/bwd_sm90.cu's bwd_preprocess_beside_kernel: threads per block (one block an SM) and the
# most slots of rows it keeps in flight.
BESIDE_THREADS, BESIDE_MAX_STAGES = 768, 8
# Its slots' shared memory at every head dim (three at 256), and 1 KB to align them: one size
# for the one kernel that serves them all.
BESIDE_SLOTS = 192 * 1024

# C++ spelling of the element type of each dtype in the kernels' template names.
ELEM = {"float16": "fp16", "bfloat16": "bf16", "float32": "float", "float64": "double"}
TENSOR_CORE = ("float16", "bfloat16")


def _tensor_ref(rec, a):
    item = a.itemsize
    rec["ptr"] = a.data.ptr
    rec["batch_stride"] = a.strides[0] // item
    rec["row_stride"] = a.strides[1] // item
    rec["head_stride"] = a.strides[2] // item


def _vec_ok(*arrays):
    """16-byte vector loads need every row of every tensor to start 16-byte aligned."""
    for a in arrays:
        if a.data.ptr % 16 or any((s % 16) for s in a.strides[:3]) or \
                (a.shape[3] * a.itemsize) % 16:
            return False
    return True


class Packed(NamedTuple):
    """A packed variable-length batch (cuda/seqinfo.cuh): CuPy int32 offsets of batch + 1
    entries and the longest sequences' lengths, which size the grids. The kernels see its
    (total, nheads, headdim) tensors as (1, total, nheads, headdim)."""
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self):
        return self.cu_seqlens_q.shape[0] - 1


class Cache(NamedTuple):
    """A KV cache's keys (cuda/seqinfo.cuh's SEQ_CACHE, SEQ_PAGED): CuPy int32 lengths before
    the call's append, the block table of a paged cache (None: contiguous), the keys appended,
    the pages' rows and the table's width, and the longest entry's keys (the grids' seqlen_k)."""
    seqlens: object
    block_table: object
    new_keys: int
    page_size: int
    pages_per_seq: int
    max_keys: int


def _dims(q, k, layout):
    """(batch, seqlen_q, seqlen_k) of the grids: q's and k's, a packed batch's, or a cache's."""
    if layout is None:
        return q.shape[0], q.shape[1], k.shape[1]
    if isinstance(layout, Cache):
        return q.shape[0], q.shape[1], layout.max_keys
    return layout.batch, layout.max_seqlen_q, layout.max_seqlen_k


def _softcap_alone_bf16(spec):
    """A bf16 call whose score modifier is softcap alone (no ALiBi, no user score_mod):
    cuda/score_mod.cuh's ``capped_alone`` in bf16, the kernels' ``OnesSum`` above head dim 128
    (cuda/fwd_sm90.cu)."""
    return spec.softcap > 0 and spec.dtype == "bfloat16" and not (spec.alibi or spec.score_mod)


def bounded_scores(spec):
    """Whether the call's scores let the kernels' softmax keep the fixed base 0 instead of a
    running max (cuda/score_mod.cuh, ScoreMod::bounded; the Hopper forward takes it above head
    dim 128, cuda/fwd_sm90.cu): softcap alone holds tanh values in [-1, 1], and
    p = exp2(t * softcap * log2(e)) then spans 2^-m .. 2^m with m = softcap * log2(e). bf16's
    P (8 exponent bits) and the fp32 sums hold that with room while m <= BOUNDED_LOG2: a row's
    largest p is at least 2^-64, its sum at most seqlen_k * 2^64. fp16's P (5 bits) would not."""
    return _softcap_alone_bf16(spec) and spec.softcap * _config.LOG2E <= BOUNDED_LOG2


def _fill_dims(p, q, k, scale, spec, alibi_slopes, dropout, layout=None):
    b, sq, sk = _dims(q, k, layout)
    h, d = q.shape[2:]
    if isinstance(layout, Packed):
        rec = p["varlen"]
        rec["cu_seqlens_q"], rec["cu_seqlens_k"] = layout.cu_seqlens_q.data.ptr, layout.cu_seqlens_k.data.ptr
        rec["total_q"] = q.shape[1]
    elif isinstance(layout, Cache):
        rec = p["cache"]
        rec["seqlens"] = layout.seqlens.data.ptr
        rec["block_table"] = 0 if layout.block_table is None else layout.block_table.data.ptr
        rec["new_keys"], rec["page_size"], rec["pages_per_seq"] = (layout.new_keys, layout.page_size,
                                                                   layout.pages_per_seq)
    p["batch"], p["nheads"], p["nheads_k"] = b, h, k.shape[2]
    p["group"] = h // k.shape[2]
    p["seqlen_q"], p["seqlen_k"], p["headdim"] = sq, sk, d
    p["scale"] = scale
    p["scale_log2"] = scale * _config.LOG2E
    # cuda/mask.cuh: a side beyond every key (row) is unbounded; clipped, no sum there
    # overflows.
    left, right = spec.window
    p["window_left"] = sk if left < 0 else min(left, sk)
    p["window_right"] = sq if right < 0 else min(right, sq)
    # cuda/score_mod.cuh: the tensor-core kernels' held values are raw q.k, or tanh(q.k *
    # scale / softcap) with a softcap; `mult` takes them to log2 units.
    mod = p["mod"]
    mod["scale"] = scale
    mult = scale * _config.LOG2E
    if spec.softcap:
        mod["softcap"] = spec.softcap
        mod["softcap_in"] = scale / spec.softcap
        mult = mod["softcap_log2"] = spec.softcap * _config.LOG2E
        mod["bounded"] = bounded_scores(spec)
    if alibi_slopes is not None:
        mod["alibi"] = alibi_slopes.data.ptr
        mod["alibi_stride"] = alibi_slopes.strides[0] // 4 if alibi_slopes.ndim == 2 else 0
        mod["alibi_unit"] = -_config.LOG2E / mult
    if spec.dropout:   # cuda/dropout.cuh; the generator's spec is cupyflash/dropout.py's
        from . import dropout as _dropout
        drop = p["drop"]
        drop["seed"], drop["offset"] = dropout
        drop["threshold"] = _dropout.threshold(spec.dropout)
        drop["scale"] = 1.0 / (1.0 - _dropout.effective_p(spec.dropout))


def _smem_limit():
    return _device_attribute("MaxSharedMemoryPerBlockOptin")


def _sm_count():
    return _device_attribute("MultiProcessorCount")


def _device_attribute(name):
    import cupy
    return _attribute_of(cupy.cuda.Device().id, name)


@functools.lru_cache(maxsize=None)
def _attribute_of(device_id, name):
    import cupy
    return cupy.cuda.Device(device_id).attributes[name]


# The largest dynamic shared memory each kernel has opted in to, per (source, name, device,
# arch): the limit belongs to the loaded function, which launches of other sizes share.
_OPTED_IN = {}
_OPT_IN_LOCK = threading.Lock()


@_compile._once_per_key
def _kernel(source, name, device_id, smem, arch=None):
    """The kernel with its dynamic shared-memory limit raised once per size (above 48 KB a
    kernel must opt in), not on every launch, and never lowered: a launch of a smaller size
    after a larger one would otherwise leave the larger one's later launches refused
    (CUDA_ERROR_INVALID_VALUE). Keyed by the source text itself, as _compile's modules are:
    another text under the same file name is another kernel. ``arch``: compiled for that
    target (an arch-specific one, _compile.ARCH_SPECIFIC), not the device's own. Once per key
    under concurrency: threads that first launched a kernel together held two objects of it,
    and a launch plan recorded with one differed from a fresh preparation holding the other
    (tests/test_distributed.py's ring of threads)."""
    import cupy
    _arrays.refuse_in_capture(cupy, f"the first call of {name} compiles and loads it")
    kernel = (_compile.get_arch_kernel(device_id, source, name, arch) if arch else get_kernel(source, name))
    if smem > 48 * 1024:
        from cupy_backends.cuda.api import driver
        with _OPT_IN_LOCK:
            key = (source, name, device_id, arch)
            _OPTED_IN[key] = max(smem, _OPTED_IN.get(key, 0))
            # A RawKernel's function is its .kernel (as _run launches it); get_arch_kernel's is itself.
            driver.funcSetAttribute(getattr(kernel, "kernel", kernel).ptr,
                                    driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, _OPTED_IN[key])
    return kernel


def _pass_tile(pass_, spec, smem_limit, block_mask, name_of, deterministic=False):
    """The tile of a pass: the table's for ``spec`` (``_config.tile``), or, for kernels with
    user code, whose registers depend on the snippet, the largest tile whose kernel compiles
    with no local memory (``name_of(tile)`` names it in ``cuda/<file>``); the table's "user"
    tile when every larger one spills."""
    limits = _tile_limits(block_mask)
    safe = _config.tile(pass_, spec.headdim, smem_limit, *limits, deterministic=deterministic,
                        extras=spec.extras)
    if not spec.user_mods:
        return safe
    import cupy
    return _user_tile(pass_, spec, smem_limit, limits, deterministic, name_of,
                      cupy.cuda.Device().id, safe)


_USER_TILES = {}


def _user_tile(pass_, spec, smem_limit, limits, deterministic, name_of, device_id, safe):
    key = (pass_, spec, smem_limit, limits, deterministic, device_id)
    if key not in _USER_TILES:
        others = tuple(e for e in spec.extras if e != "user")
        chosen = safe
        for t in _config.tiles(pass_, spec.headdim, smem_limit, *limits, deterministic):
            if t == safe:
                break
            if t.spills_with.intersection(others):
                continue
            filename, name, smem = name_of(t)
            kernel = _kernel(_compile.source(filename, spec.user_mods), name, device_id, smem,
                             _compile.ARCH_SPECIFIC.get(filename))
            if kernel.attributes["local_size_bytes"] == 0:
                chosen = t
                break
        _USER_TILES[key] = chosen
    return _USER_TILES[key]


_deferred = threading.local()   # a check to run before this thread's next launch or fill


@contextlib.contextmanager
def checked_before_launch(check):
    """Run ``check()`` (which may raise) inside the block just before its first launch or
    fill (``settle``), or at its end where there is none. The host work before that launch
    (parameters, tensor maps) then runs while the GPU works through the stream's earlier
    work, which a read to the host that ``check`` waits for queues behind; an error still
    comes before anything is launched."""
    settle()
    _deferred.check = check
    try:
        yield
        settle()
    finally:
        _deferred.check = None


def settle():
    """Run the pending ``checked_before_launch`` check, if any: every launch and fill of a
    call comes after it."""
    check = getattr(_deferred, "check", None)
    if check is not None:
        _deferred.check = None
        check()


def zeros(shape, dtype):
    """``cupy.zeros`` (a fill on the stream) after ``settle``; a step of the launch plan being
    recorded."""
    return _allocate(shape, dtype, True)


def empty(shape, dtype):
    """``cupy.empty``, a step of the launch plan being recorded."""
    return _allocate(shape, dtype, False)


def _allocate(shape, dtype, zero):
    import cupy
    if zero:
        settle()
    a = (cupy.zeros if zero else cupy.empty)(shape, dtype)
    rec = getattr(_recording, "rec", None)
    if rec is not None:
        rec.allocated(a, shape, dtype, zero)
    return a


def _launch(filename, name, grid, threads, smem, params, user_mods="", dependent=False):
    """Launch template instantiation ``name`` of ``cuda/<filename>``, with the call's user
    mods (``mods.prelude``) spliced into its source; ``params``: its one argument, or a tuple
    of them (NumPy scalars). ``dependent``: as the programmatic dependent of the kernel before
    it in the stream (sm_90), which may then start it once each of its blocks has run
    ``launch_dependents`` (cuda/common.cuh), beside its last ones: the kernel waits for what it
    reads itself."""
    import cupy
    settle()
    kernel = _kernel(_compile.source(filename, user_mods), name, cupy.cuda.Device().id, smem,
                     _compile.ARCH_SPECIFIC.get(filename))
    _run(kernel, grid, threads, smem, params if isinstance(params, tuple) else (params,), dependent)


def _run(kernel, grid, threads, smem, args, dependent):
    """Launch ``kernel`` on CuPy's current stream (the last step of ``_launch`` and of a plan's
    replay); recorded, and with ``launch=False`` not run, while a plan is recorded."""
    import cupy
    settle()
    rec = getattr(_recording, "rec", None)
    if rec is not None:
        rec.launched(kernel, grid, threads, smem, args, dependent)
        if not rec.launch:
            return
    if dependent and _driver.launch_dependent(getattr(kernel, "kernel", kernel).ptr, grid, threads, smem,
                                              cupy.cuda.get_current_stream().ptr, args):
        return
    kernel(grid, (threads,), args, shared_mem=smem)


# Launch plans. Preparing a call's launches (the tile, the grid, the parameter records, the
# tensor maps, the kernel) takes ~400 Python calls of host time, and for one call signature
# (the arrays' shapes, strides, dtypes and 16-byte alignment, which arrays are the same one,
# the options, the device, CUPYFLASH_KERNELS) it comes out the same but for the addresses.
# The first call of a signature runs as usual while the launches and the buffers it makes are
# recorded; the record becomes a plan: per launch the kernel, grid, block and shared memory,
# and its parameters with each address field (every uint64 field but the dropout seed) noted
# as an array of the call (or a buffer of the plan) plus an offset, and each tensor map as the
# map of such an array. Later calls of the signature make the buffers and fill the addresses
# (and the maps, kept per plan by address) into copies of the parameters. CUPYFLASH_CHECK_PLANS=1 (the
# test suite sets it) records every planned call afresh, without launching, and asserts that
# its plan is the one replayed. CUPYFLASH_LAUNCH_PLANS=0 prepares (and checks, api._signature)
# every call afresh.
MAX_PLANS = 256
_PLANS = collections.OrderedDict()
_recording = threading.local()   # .rec: the _Recorder of the plan being made on this thread


class _Recorder:
    """The steps of one call, for a plan: buffers made (``allocated``), kernels launched
    (``launched``) and tensor maps made (``mapped``)."""

    def __init__(self, arrays, launch):
        self.arrays = list(arrays)    # the call's arrays, then the buffers made, in order
        self.steps = []
        self.maps = {}
        self.launch = launch

    def __enter__(self):
        if getattr(_recording, "rec", None) is not None:
            raise AssertionError("launch plans do not nest")
        _recording.rec = self
        return self

    def __exit__(self, *exc):
        _recording.rec = None

    def allocated(self, a, shape, dtype, zero):
        self.steps.append(("alloc", tuple(shape) if isinstance(shape, tuple) else (shape,),
                           np.dtype(dtype), zero))
        self.arrays.append(a)

    def launched(self, kernel, grid, threads, smem, args, dependent):
        self.steps.append(("launch", kernel, tuple(grid), threads, smem, dependent,
                           tuple(np.array(a) for a in args)))

    def mapped(self, desc, ptr, dtype, dims, strides, box):
        self.maps[desc.tobytes()] = (ptr, dtype, dims, strides, box)

    def plan(self):
        """The _Plan of the recorded steps, or None where an address field holds an address
        of no array of the call."""
        spans = [(a.data.ptr, a.data.ptr + _extent(a)) if a is not None else (0, 0) for a in self.arrays]
        steps = []
        for step in self.steps:
            if step[0] == "alloc":
                steps.append(step)
                continue
            args = []
            for a in step[6]:
                arg = _ArgPlan.of(a, spans, self.maps)
                if arg is None:
                    return None
                args.append(arg)
            steps.append(step[:6] + (tuple(args),))
        return _Plan(tuple(steps))


def _extent(a):
    """Bytes from ``a``'s first element to just past its last one (non-negative strides)."""
    return sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize if a.size else 0


@functools.lru_cache(maxsize=None)
def _address_words(dtype):
    """(64-bit words that hold addresses, first words of tensor maps) of a parameter's dtype:
    its uint64 fields but the dropout seed, and its TMA_DESC fields."""
    words, maps = [], []

    def walk(dt, offset, name):
        if dt == _tma.TMA_DESC:
            maps.append(offset // 8)
        elif dt.fields is not None:
            for field, (sub, at) in dt.fields.items():
                walk(sub, offset + at, field)
        elif dt.subdtype is not None:
            base, shape = dt.subdtype
            for i in range(int(np.prod(shape))):
                walk(base, offset + i * base.itemsize, name)
        elif dt == np.uint64 and name != "seed":
            words.append(offset // 8)
    walk(np.dtype(dtype), 0, "")
    return tuple(words), tuple(maps)


class _ArgPlan(NamedTuple):
    """One kernel parameter of a plan: its bytes with the addresses left out (``template``,
    uint64 words), where they go (``words``), whose they are (``sources``: indices into the
    call's arrays and the plan's buffers) and at which offsets (``deltas``), and its tensor
    maps as (first word, source, dtype, dims, strides, box)."""
    dtype: np.dtype
    template: np.ndarray
    words: np.ndarray
    sources: np.ndarray
    deltas: np.ndarray
    maps: tuple
    encoded: dict   # (first word, address) -> the map's words: the maps of the last addresses seen

    @classmethod
    def of(cls, value, spans, made_maps):
        words, map_words = _address_words(value.dtype)
        buf = np.zeros(_config.cdiv(value.dtype.itemsize, 8), np.uint64)
        buf.view(np.uint8)[:value.dtype.itemsize] = np.frombuffer(value.tobytes(), np.uint8)
        slots, maps = [], []
        for w in words:
            if buf[w]:
                source = _source(int(buf[w]), spans)
                if source is None:
                    return None
                slots.append((w, source, int(buf[w]) - spans[source][0]))
                buf[w] = 0
        for w in map_words:
            desc = buf[w:w + _MAP // 8].tobytes()
            if not any(desc):
                continue
            ptr, *rest = made_maps.get(desc, (None,))
            source = None if ptr is None else _source(ptr, spans)
            if source is None or spans[source][0] != ptr:
                return None
            maps.append((w, source, *rest))
            buf[w:w + _MAP // 8] = 0
        return cls(value.dtype, buf, np.array([s[0] for s in slots], np.intp),
                   np.array([s[1] for s in slots], np.intp), np.array([s[2] for s in slots], np.uint64),
                   tuple(maps), {})

    def key(self):
        return (self.dtype, self.template.tobytes(), self.words.tobytes(), self.sources.tobytes(),
                self.deltas.tobytes(), self.maps)

    def fill(self, ptrs):
        """The parameter for arrays at ``ptrs`` (uint64, one per source)."""
        buf = self.template.copy()
        buf[self.words] = ptrs[self.sources] + self.deltas
        for w, source, dtype, dims, strides, box in self.maps:
            words = self.encoded.get((w, ptrs[source]))
            if words is None:
                if len(self.encoded) >= 64:
                    self.encoded.clear()
                words = self.encoded[w, ptrs[source]] = _tma.tiled(int(ptrs[source]), dtype, dims, strides,
                                                                   box)["words"]
            buf[w:w + _MAP // 8] = words
        return buf.view(np.uint8)[:self.dtype.itemsize].view(self.dtype)[0]


def _source(ptr, spans):
    """The index of the array an address belongs to: the first that starts there, else the
    only one that holds it (None if none does, or several)."""
    for i, (start, _) in enumerate(spans):
        if start == ptr:
            return i
    holders = [i for i, (start, end) in enumerate(spans) if start < ptr < end]
    return holders[0] if len(holders) == 1 else None


class _Plan(NamedTuple):
    steps: tuple

    def key(self):
        return tuple(s if s[0] == "alloc" else s[:6] + (tuple(a.key() for a in s[6]),) for s in self.steps)

    def replay(self, ptrs):
        """Run the plan for arrays at ``ptrs`` (0 where absent)."""
        ptrs = list(ptrs)   # then the buffers', as they are made
        made = []   # the buffers live until the launches that use them are queued
        for step in self.steps:
            if step[0] == "alloc":
                a = _allocate(*step[1:])
                made.append(a)
                ptrs.append(a.data.ptr)
                continue
            _, kernel, grid, threads, smem, dependent, args = step
            at = np.array(ptrs, np.uint64)
            _run(kernel, grid, threads, smem, tuple(a.fill(at) for a in args), dependent)


def _planned(run, arrays, options, plannable=True):
    """``run()`` (a launch function's body over the CuPy ``arrays``, None where absent), or the
    plan of its signature (``options``: everything else it depends on, hashable)."""
    if not plannable or os.environ.get("CUPYFLASH_LAUNCH_PLANS", "1") == "0":
        return run()
    import cupy
    ptrs = [a.data.ptr if a is not None else 0 for a in arrays]
    key = (cupy.cuda.Device().id, os.environ.get("CUPYFLASH_KERNELS", ""), options,
           tuple(None if a is None else (a.shape, a.strides, a.dtype, p % 16, ptrs.index(p))
                 for a, p in zip(arrays, ptrs)))
    plan = _PLANS.get(key)
    if plan is None and key not in _PLANS:
        with _Recorder(arrays, launch=True) as rec:
            run()
        _PLANS[key] = rec.plan()
        if len(_PLANS) > MAX_PLANS:
            _PLANS.popitem(last=False)
        return
    if plan is None:
        return run()
    _PLANS.move_to_end(key)
    if os.environ.get("CUPYFLASH_CHECK_PLANS") == "1":
        with _Recorder(arrays, launch=False) as rec:
            run()
        fresh = rec.plan()
        if fresh is None or fresh.key() != plan.key():
            raise AssertionError("a launch plan differs from a fresh preparation of its call")
    plan.replay(ptrs)


def _fill_user(rec, arrays, grads=None):
    """UserParams: the mods' arrays (CuPy, C-contiguous, slot order) and the gradient buffers
    (by slot) of those a score_mod differentiates."""
    for slot, a in enumerate(arrays or ()):
        rec["arrays"][slot] = a.data.ptr
        rec["shape"][slot] = tuple(a.shape) + (1,) * (USER_NDIM - a.ndim)
    for slot, g in (grads or {}).items():
        rec["grads"][slot] = g.data.ptr


CLASSIFY_THREADS = 256
CLASSIFY_PARAMS = np.dtype([("user", USER_PARAMS), ("counts", np.uint64), ("seqlen_q", np.int32),
                            ("seqlen_k", np.int32), ("block_q", np.int32), ("block_k", np.int32),
                            ("heads", np.int32)], align=True)


def classify_blocks(user_mods, arrays, seqlen_q, seqlen_k, block_q, block_k, heads, batch):
    """Visible elements per block of a user mask_mod, summed over the batch: CuPy int32
    (heads, nbq, nbk) (cuda/classify.cu)."""
    import cupy
    nbq, nbk = _config.cdiv(seqlen_q, block_q), _config.cdiv(seqlen_k, block_k)
    if heads * batch > _config.MAX_GRID_YZ or nbq > _config.MAX_GRID_YZ:
        raise ValueError(f"mask_mod: (batch x nheads, query blocks) = ({heads * batch}, {nbq}) "
                         f"exceeds the grid limit {_config.MAX_GRID_YZ}")
    counts = zeros((heads, nbq, nbk), cupy.int32)
    p = np.zeros((), CLASSIFY_PARAMS)
    _fill_user(p["user"], arrays)
    p["counts"] = counts.data.ptr
    p["seqlen_q"], p["seqlen_k"], p["block_q"], p["block_k"], p["heads"] = (
        seqlen_q, seqlen_k, block_q, block_k, heads)
    _launch("classify.cu", template_name("classify_blocks_kernel", "UserMods"),
            (nbk, nbq, heads * batch), CLASSIFY_THREADS, 0, p[()], user_mods)
    return counts


def _generic_smem(d_bucket, itemsize):
    # K and V chunks of GENERIC_CHUNK rows, rows padded by one element against bank conflicts.
    return 2 * _config.GENERIC_CHUNK * (d_bucket + 1) * itemsize


def _tile_grid(p, tiles, heads, batch, longest_first, pair_bytes=0, l2_part=1):
    """The grid of a tensor-core pass over tiles x heads x batch (block_coord in
    cuda/block_iter.cuh). A pass whose tiles differ in length (``longest_first``: causal, or a
    causal-like mask_mod, ``sm90_grouped``) gets (group, tiles, groups), which starts the long
    tiles of a group of (head, batch) pairs before its short ones (``_launch_group`` pairs;
    ``pair_bytes`` and ``l2_part`` as there)."""
    p["launch_group"] = 0
    if not longest_first:
        return (tiles, heads, batch)
    pairs = heads * batch
    group = _launch_group(pairs, tiles, pair_bytes, l2_part)
    if max(tiles, _config.cdiv(pairs, group)) > _config.MAX_GRID_YZ:
        return (tiles, heads, batch)
    p["launch_group"] = group
    return (group, tiles, _config.cdiv(pairs, group))


def _launch_group(pairs, tiles, pair_bytes=0, l2_part=1):
    """(Head, batch) pairs per launch group of a causal pass. With ``pair_bytes``, what all of
    a pair's tiles read (the Hopper passes: K and V in the forward; Q, dO and the fp32 dQ in
    the backward), the most pairs, a power of two, whose bytes fit in the L2 (in 1 /
    ``l2_part`` of it: ``sm90_fwd_l2_part``), so that a group reads them from memory once;
    measured on the H200 against LAUNCH_GROUP_WAVES (which groups up to 66 pairs at 2K: 66 MB
    of K and V at d = 128), +0.7 to +10.6% in the causal forward and -0.2 to +7.0% in the
    backward, most at 2K (benchmarks/NOTES.md, twenty-seventh session). Else enough tiles to
    fill every SM LAUNCH_GROUP_WAVES times (fewer pairs per group keep more of a head's data
    in L2 while its tiles run, more spread the long tiles better)."""
    if pair_bytes:
        fit = max(1, _device_attribute("L2CacheSize") // (l2_part * pair_bytes))
        return min(pairs, 1 << (fit.bit_length() - 1))
    return min(pairs, _config.cdiv(LAUNCH_GROUP_WAVES * _sm_count(), tiles))


def _tile_limits(block_mask):
    return (block_mask.block_q, block_mask.block_k) if block_mask is not None else ()


def _fill_lists(p, block_mask, tile_q, tile_k, causal, kv, q):
    """Point p's kv_blocks (``kv``) and/or q_blocks (``q``) at the mask's lists for tiles of
    tile_q x tile_k."""
    import cupy
    tl = block_mask.tile_lists(tile_q, tile_k, causal, cupy)
    for on, field, lists, row_tile, list_tile in (
            (kv, "kv_blocks", (tl.kv_idx, tl.kv_count, tl.kv_partial), tile_q, tile_k),
            (q, "q_blocks", (tl.q_idx, tl.q_count, tl.q_partial), tile_k, tile_q)):
        if on:
            rec = p[field]
            rec["idx"], rec["count"], rec["partial"] = (a.data.ptr for a in lists)
            _, rec["rows"], rec["width"] = lists[0].shape
            rec["heads"] = block_mask.heads
            rec["row_tile"], rec["list_tile"] = row_tile, list_tile


def _check_lists(p, field, row_tile, list_tile):
    """A tensor-core kernel knows its tiles only as template constants: a list made for other
    tiles would be read with the wrong geometry, silently."""
    rec = p[field]
    if rec["idx"] and (rec["row_tile"], rec["list_tile"]) != (row_tile, list_tile):
        raise AssertionError(f"{field} lists are for {rec['row_tile']} x {rec['list_tile']} tiles, "
                             f"the kernel's are {row_tile} x {list_tile}")


def check_supported(spec, block_mask):
    """Raise, before anything is allocated, where the current GPU cannot run this call:
    fp16/bf16 need tensor cores of sm_80+, and every kernel's tile must fit its shared
    memory; dropout with softcap, ALiBi or a score_mod has no kernels yet."""
    if spec.dropout and (spec.softcap or spec.alibi or spec.score_mod):
        raise NotImplementedError("dropout_p > 0 with softcap, alibi_slopes or a score_mod has "
                                  "no GPU kernels yet (NumPy arrays run it)")
    import cupy
    _supported_on(cupy.cuda.Device().id, spec, _tile_limits(block_mask))


@functools.lru_cache(maxsize=1024)   # what passes is kept; an error is raised again each time
def _supported_on(device_id, spec, limits):
    import cupy
    dev = cupy.cuda.Device(device_id)
    hd = spec.headdim
    limit = _attribute_of(device_id, "MaxSharedMemoryPerBlockOptin")
    if spec.dtype in TENSOR_CORE:
        cc = int(dev.compute_capability)
        if cc < 80:
            raise TypeError(f"{spec.dtype} needs tensor cores of compute capability 8.0 or newer; "
                            f"device {dev.id} is {cc // 10}.{cc % 10} (use float32)")
        try:
            for pass_ in ("fwd", "bwd", "dq"):
                _config.tile(pass_, hd, limit, *limits, extras=spec.extras)
        except RuntimeError as e:
            raise ValueError(f"headdim bucket {hd} with {spec.dtype}: {e}") from None
    else:
        itemsize = np.dtype(spec.dtype).itemsize
        if _generic_smem(hd, itemsize) > limit:
            raise ValueError(f"headdim bucket {hd} with {spec.dtype} needs "
                             f"{_generic_smem(hd, itemsize)} bytes of shared memory per block; "
                             f"device {dev.id} has {limit}")


# cuda/fwd_sm90.cu's parameters: the tensor maps of q, k, v and o (64-byte aligned), FwdParams,
# the counter of tiles handed out and the grid of tiles the persistent blocks take; the size
# rounded up to 64 bytes as the C struct's.
_MAP = _tma.TMA_DESC.itemsize
_AFTER_MAPS = 4 * _MAP + FWD_PARAMS.itemsize
FWD_SM90_PARAMS = np.dtype({"names": ["q", "k", "v", "o", "base", "counter", "grid"],
                            "formats": [_tma.TMA_DESC] * 4 + [FWD_PARAMS, np.uint64, (np.int32, 3)],
                            "offsets": [0, _MAP, 2 * _MAP, 3 * _MAP, 4 * _MAP, _AFTER_MAPS, _AFTER_MAPS + 8],
                            "itemsize": _config.cdiv(_AFTER_MAPS + 8 + 12, 64) * 64})
SM90_BWD_THREADS = 384


def sm90_headdim(bucket):
    """The Hopper forward's head dim for a bucket: whole 64-column swizzle atoms (the copy
    engine fills the columns past the real head dim with zeros)."""
    return _config.cdiv(bucket, 64) * 64


def sm90_fwd_keys(spec, block_mask):
    """Keys per block of the Hopper forward (cuda/fwd_sm90.cu's Keys): 128 up to head dim 128;
    above, 64, but 80 at 256 (S = Q K^T by m64n80: 25% more FLOPs per byte of Q read from
    shared memory than m64n64; measured there only) for calls without a block mask (80
    divides no mask block; a mask_mod comes with one). A user score_mod's 80-key kernel is
    checked at the call (``sm90_fwd_call_tile``)."""
    hd = sm90_headdim(spec.headdim)
    if hd <= 128:
        return 128
    return 80 if hd == 256 and block_mask is None else 64


def sm90_fwd_groups(spec, block_mask):
    """Consumer warpgroups of the Hopper forward (64 query rows each; cuda/fwd_sm90.cu's
    Groups): three at head dim 64, where one warpgroup's softmax takes as long as its products,
    except with a block mask (192-row tiles divide no mask block; a mask_mod comes with one)
    or softcap alone (on three, 1.6-2.5% slower in causal calls and at 2K; softcap with ALiBi
    10-19% faster there; H200, benchmarks/NOTES.md, fiftieth session), or softcap with ALiBi in
    packed batches (the causal kernel spilled 8 bytes on three under NVRTC 13.5); else two. A
    user score_mod's three-consumer kernel is checked at the call (``sm90_fwd_call_tile``)."""
    plain = block_mask is None and not (spec.softcap and (spec.varlen or not spec.alibi))
    return 3 if sm90_headdim(spec.headdim) == 64 and plain else 2


def sm90_fwd_tile(spec, block_mask):
    """(Groups, Keys) of the Hopper forward's kernel for this call."""
    return sm90_fwd_groups(spec, block_mask), sm90_fwd_keys(spec, block_mask)


def _sm90_fwd_name(spec, hd, groups, keys):
    return template_name("flash_fwd_sm90_kernel", ELEM[spec.dtype], hd, spec.variant(), groups, keys)


def sm90_fwd_call_tile(spec, block_mask):
    """``sm90_fwd_tile``, except for a user score_mod at head dims 64 and 256: three consumers
    at 64 and 80-key blocks at 256 where its snippet reads no memory per score
    (``mods.reads_table``) and that kernel, compiled and loaded first, has the registers it
    needs (``_short_of_registers``), else two consumers and 64 keys. On the H200 three
    consumers measured 5-15% faster for a score_mod of ALiBi's, and 10% slower for a table
    lookup per score in causal calls (equal in others); 80 keys 3-5% faster for a score_mod
    of ALiBi's (benchmarks/NOTES.md), where a table lookup per score spilled under NVRTC 13.0."""
    groups, keys = sm90_fwd_tile(spec, block_mask)
    hd = sm90_headdim(spec.headdim)
    if (groups == 3 or keys == 80) and spec.score_mod and (mods.reads_table(spec.user_mods) or _short_of_registers(
            "fwd_sm90.cu", spec, _sm90_fwd_name(spec, hd, groups, keys))):
        groups, keys = 2, 64 if keys == 80 else keys
    return groups, keys


def _short_of_registers(filename, spec, name):
    """Whether a Hopper kernel of a call's user mods (compiled and loaded for the current
    device) has local memory or had its wgmma serialized by ptxas: it would run, slower than
    a kernel of another shape."""
    import cupy
    from cupy_backends.cuda.api import driver
    code, arch = _compile.source(filename, spec.user_mods), _compile.ARCH_SPECIFIC[filename]
    kernel = _compile.get_arch_kernel(cupy.cuda.Device().id, code, name, arch)
    return bool(driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, kernel.ptr)
                or _compile.wgmma_serialized(code, name, arch))


def sm90_fwd_smem(hd, groups, keys):
    """Q (64 rows per consumer warpgroup; two buffers for hd <= 128, the persistent kernels),
    two buffers of K and of V (`keys` rows each) and, for hd <= 128, O's stage (as Q), 16-bit
    elements, and 1 KB to align them to 1024 bytes."""
    rows = 64 * groups
    q_and_o_rows = 3 * rows if hd <= 128 else rows
    return (q_and_o_rows + 2 * 2 * keys) * hd * 2 + 1024


def kernel_family(spec, block_mask, *arrays):
    """"sm90" where the Hopper kernels (cuda/fwd_sm90.cu) run this call's forward, else
    "generic" (the mma.sync and plain kernels, on every GPU). CUPYFLASH_KERNELS=generic forces
    the generic kernels (to compare the two on one GPU). The Hopper forward covers, so far:
    fp16/bf16 with 16-byte aligned rows (the copy engine's rule), every head-dim bucket, every
    band, softcap, ALiBi and user mods, and block masks whose blocks its tiles divide (64 x
    sm90_fwd_groups queries x sm90_fwd_keys); the rest (dropout: slower there so far) runs
    the generic kernels."""
    rows = 64 * sm90_fwd_groups(spec, block_mask)
    if (_hopper_allowed() and spec.dtype in TENSOR_CORE
            and not spec.dropout
            and (block_mask is None or (block_mask.block_q % rows == 0 and block_mask.block_k
                                        % sm90_fwd_keys(spec, block_mask) == 0))
            and _vec_ok(*arrays)):
        return "sm90"
    return "generic"


# cuda/bwd_sm90.cu's parameters: the tensor maps of q, k, v, dout, dk and dv, BwdParams, the
# deterministic dQ's counters (or 0) and the counts of finished blocks (or 0).
_AFTER_BWD = _config.cdiv(6 * _MAP + BWD_PARAMS.itemsize, 8) * 8
BWD_SM90_PARAMS = np.dtype({"names": ["q", "k", "v", "dout", "dk", "dv", "base", "dq_order", "dq_done", "ready"],
                            "formats": [_tma.TMA_DESC] * 6 + [BWD_PARAMS, np.uint64, np.uint64, np.uint64],
                            "offsets": [i * _MAP for i in range(7)] + [_AFTER_BWD, _AFTER_BWD + 8, _AFTER_BWD + 16],
                            "itemsize": _config.cdiv(_AFTER_BWD + 24, 64) * 64})
# cuda/bwd_sm90.cu's BesideParams: the tensor maps of out and dout, BwdParams, the flags, the
# slots and the pairs of a group.
_AFTER_BESIDE = _config.cdiv(2 * _MAP + BWD_PARAMS.itemsize, 8) * 8
BESIDE_PARAMS = np.dtype({"names": ["o", "dout", "base", "ready", "stages", "group_pairs"],
                          "formats": [_tma.TMA_DESC] * 2 + [BWD_PARAMS, np.uint64, np.int32, np.int32],
                          "offsets": [0, _MAP, 2 * _MAP, _AFTER_BESIDE, _AFTER_BESIDE + 8, _AFTER_BESIDE + 12],
                          "itemsize": _config.cdiv(_AFTER_BESIDE + 16, 64) * 64})
SM90_BWD_KEYS = 128


def sm90_bwd_headdim(bucket):
    """The Hopper backward's head dim for a bucket: 64 or 128 (cuda/bwd_sm90.cu's
    flash_bwd_sm90_kernel), or 256 above 128 (flash_bwd_sm90_wide_kernel); the copy engine
    fills the columns past the real head dim with zeros."""
    hd = sm90_headdim(bucket)
    return hd if hd <= 128 else 256


def sm90_bwd_keys(hd):
    """Keys per block of the Hopper backward: 128 (two warpgroups of 64), 64 at head dim 256
    (both warpgroups on the same keys, half the head dim each)."""
    return 64 if hd == 256 else SM90_BWD_KEYS


# Causal calls take 80-query steps from this many query rows on. A key block's steps start on a
# multiple of 80 below its diagonal and the last one ends past seqlen_q: masked rows that
# short calls pay more for than the 80-row products save (benchmarks/NOTES.md, twenty-fourth
# session: 4K -2%, 8K +1.3%, 16K +2.5% against 64 rows).
SM90_BWD_CAUSAL_80_FROM = 8192
# Windows closed on both sides take 80-query steps where a key block's band spans this many
# query rows or more (left + right + 1, at most seqlen_q): the steps' masked rows at both of
# the band's ends, against the rows between them (benchmarks/NOTES.md, thirty-fifth session:
# window (1024, 0) at 8K -1.8%, (2048, 0) +1.2%, (4096, 0) at 32K +3.4% against 64 rows).
# A window open on one side has a causal call's shape and takes its rule.
SM90_BWD_LOCAL_80_FROM = 2048


def _band_takes_80(spec, seqlen_q):
    left, right = spec.window
    if left < 0 or right < 0:
        return seqlen_q >= SM90_BWD_CAUSAL_80_FROM
    return min(left + right + 1, seqlen_q) >= SM90_BWD_LOCAL_80_FROM


def sm90_bwd_rows(hd, spec=None, block_mask=None, deterministic=False, seqlen_q=0):
    """Query rows per step of the Hopper backward: 128 at head dim 64 (S^T and dP^T by wgmma
    with 128 queries); 64 at 256 (the wide kernel); at 128 (dK and dV take 128 registers) 80,
    fewer shared-memory bytes per FLOP with dQ made transposed (cuda/bwd_sm90.cu), for calls
    without a band, causal ones of ``SM90_BWD_CAUSAL_80_FROM`` query rows or more and windows
    of ``SM90_BWD_LOCAL_80_FROM`` rows or more (neither packed), without a block mask, mask_mod
    or deterministic order, else 64 (a user score_mod's kernel is checked once compiled:
    ``sm90_bwd_step``). Without ``spec``: the rows of calls that cannot take 80."""
    if hd == 64:
        return 128
    band_ok = spec is not None and (spec.window == _spec.NO_WINDOW
                                    or (not spec.varlen and _band_takes_80(spec, seqlen_q)))
    wide_rows = (hd == 128 and band_ok and block_mask is None
                 and not deterministic and not spec.mask_mod)
    return 80 if wide_rows else 64


def sm90_bwd_rows_of_variant(hd, spec):
    """Every step of ``sm90_bwd_rows`` that a call of ``spec``'s variant (its kernel's template
    arguments) may take, at any length or window: for the kernels to compile."""
    seqlen_q = max(SM90_BWD_CAUSAL_80_FROM, SM90_BWD_LOCAL_80_FROM)
    wide = dataclasses.replace(spec, window=(seqlen_q, 0)) if spec.local else spec
    return sorted({sm90_bwd_rows(hd), sm90_bwd_rows(hd, wide, seqlen_q=seqlen_q)})


def _bwd_sm90_name(spec, hd, rows):
    if hd == 256:
        return template_name("flash_bwd_sm90_wide_kernel", ELEM[spec.dtype], spec.variant())
    return template_name("flash_bwd_sm90_kernel", ELEM[spec.dtype], hd, rows, spec.variant())


def sm90_bwd_step(spec, block_mask, deterministic, seqlen_q):
    """The rows of a call's Hopper backward: ``sm90_bwd_rows``, except that a user
    score_mod's 80-row kernel is compiled and loaded first, and where it has local memory or
    ptxas serialized its wgmma (registers run short beside some snippets: a table lookup per
    score measured 13% slower than at 64 rows, benchmarks/NOTES.md) the call takes 64, as
    ``_user_tile`` picks the generic kernels' tiles."""
    hd = sm90_bwd_headdim(spec.headdim)
    rows = sm90_bwd_rows(hd, spec, block_mask, deterministic, seqlen_q)
    if rows == 80 and spec.score_mod and _short_of_registers("bwd_sm90.cu", spec,
                                                             _bwd_sm90_name(spec, hd, rows)):
        return 64
    return rows


def _hopper_allowed():
    """The current device is sm_90 and CUPYFLASH_KERNELS does not force the generic kernels."""
    import cupy
    return (os.environ.get("CUPYFLASH_KERNELS", "auto") != "generic"
            and cupy.cuda.Device().compute_capability == "90")


def convert_overlaps(spec, block_mask):
    """Whether the Hopper backward's dQ convert runs beside the dK/dV pass's last blocks (the
    pass triggers its programmatic dependent in every block, cuda/bwd_sm90.cu's block_done)
    rather than after them (launched as the dependent all the same, it then starts once the
    pass's blocks have exited, on the launch's latency): each convert block then waits for its
    (batch, kv head)'s count of finished pass blocks, a memory round trip ahead of its loads.
    Measured (H200, bf16, 16K tokens; benchmarks/NOTES.md, sixteenth session): +0.5-1.7% in the
    128- and 256-column kernels (head dims above 64) without a band; in the 64-column one the
    waits cost what the overlap saves, and causal (longest tiles first; a causal block mask's
    too) the pass's last blocks are short and the waits cost 1-3%. With a block mask the convert
    is a larger share of the call: a random 10% mask at 8K, bf16, d=128, 7% faster; window
    (1024, 0) +1.7% at 8K, +0.3% at 32K, d=256 even (thirty-fourth session)."""
    return not spec.causal and sm90_bwd_headdim(spec.headdim) >= 128


def preprocess_beside(spec, step, block_mask=None):
    """Whether the Hopper backward's preprocess runs beside its dK/dV pass of ``step``-query
    steps rather than before it (cuda/bwd_sm90.cu's bwd_preprocess_beside_kernel): on one SM in
    PREPROCESS_BESIDE_SMS, its units of rows flagged as they are done, the pass waiting per
    step for its rows' flags. It reads dout through the pass's tensor map, whose boxes are a
    step's rows: steps of PREPROCESS_ROWS. Packed rows, 80-query steps and head dim 64 keep it
    before the pass (the wait in their producer cost registers: cuda/bwd_sm90.cu's
    reads_beside), and so does head dim 256, where it gained nothing (causal 8K -0.3%, 16K
    -1%; causal 2K and 4K at d=128 +1.8-2.2%, the window (1024, 0) at 32K +4.1%: H200, bf16,
    16K tokens, benchmarks/NOTES.md, forty-sixth session). So do ALiBi and block masks
    (mask_mods' too): the flag's acquire each step invalidates the SM's L1, which their
    consumers read the slopes and the block lists through every step (mask_mods' kernels are
    compiled without the wait: reads_beside); beside, ALiBi's causal
    backward took 6-11% longer, a causal block mask's 9% and mask_mods' 2-4% (H200, bf16,
    d=128, forty-eighth session)."""
    return (not spec.varlen and not spec.alibi and not spec.mask_mod and block_mask is None
            and step == PREPROCESS_ROWS and sm90_bwd_headdim(spec.headdim) == 128)


# One SM in this many takes a block of the preprocess beside the pass.
PREPROCESS_BESIDE_SMS = 8


def _preprocess_beside(p, ready, spec, out, tp, tiles):
    """Launch cuda/bwd_sm90.cu's bwd_preprocess_beside_kernel for the dK/dV pass of ``tiles``
    key tiles per (batch, kv head) whose parameters ``tp`` (BWD_SM90_PARAMS: its dout map, and
    its BwdParams ``p`` with the launch group set) it shares, with the flags ``ready``."""
    bp = np.zeros((), BESIDE_PARAMS)
    bp["o"] = _row_map(out, spec.dtype, PREPROCESS_ROWS)
    bp["dout"] = tp["dout"]
    bp["base"] = p
    bp["ready"] = ready
    row_bytes = 2 * _config.cdiv(spec.headdim, 64) * 64 * PREPROCESS_ROWS * 2   # a unit's O and dO boxes
    bp["stages"] = min(BESIDE_MAX_STAGES, BESIDE_SLOTS // row_bytes)
    units = int(p["batch"]) * int(p["nheads"]) * _config.cdiv(int(p["seqlen_q"]), PREPROCESS_ROWS)
    blocks = max(1, min(units, _sm_count() // PREPROCESS_BESIDE_SMS))
    # The pairs whose units the pass reads first: its launch group, or its first wave's pairs.
    bp["group_pairs"] = int(p["launch_group"]) or _config.cdiv(_sm_count(), tiles)
    _launch("bwd_sm90.cu", template_name("bwd_preprocess_beside_kernel", ELEM[spec.dtype]), (blocks, 1, 1),
            BESIDE_THREADS, BESIDE_SLOTS + 1024, bp[()])


def bwd_family(spec, block_mask, *arrays, deterministic=False):
    """"sm90" where the Hopper dK/dV pass (cuda/bwd_sm90.cu) runs this call's backward with dQ
    added by the copy engine into an fp32 buffer, else "generic". It covers fp16/bf16 with
    16-byte aligned rows, every head-dim bucket, every band, softcap, ALiBi and user mods,
    block masks whose blocks its tiles divide (``sm90_bwd_rows`` queries x ``sm90_bwd_keys``
    keys); dropout runs the generic kernels. ``deterministic``: dense or causal
    calls only (the key blocks add dQ in key order, which is then every block's rank among a
    query block's visitors); a window or a block mask runs the generic deterministic pass."""
    if deterministic and (spec.local or block_mask is not None):
        return "generic"
    hd = sm90_bwd_headdim(spec.headdim)
    keys = sm90_bwd_keys(hd)
    if (_hopper_allowed() and spec.dtype in TENSOR_CORE
            and not spec.dropout
            and (block_mask is None or (block_mask.block_q % sm90_bwd_rows(hd) == 0
                                        and block_mask.block_k % keys == 0))
            and _vec_ok(*arrays)):
        return "sm90"
    return "generic"


def _row_map(x, dtype, rows):
    """The tensor map of a (batch, seqlen, nheads, headdim) array for the Hopper kernels: one
    copy brings 64 columns of ``rows`` rows of one head."""
    b, _, h, d = x.shape
    shape = (dtype, (d, h, x.shape[1], b), (x.strides[2], x.strides[1], x.strides[0]), (64, 1, rows, 1))
    desc = _tma.tiled(x.data.ptr, *shape)
    rec = getattr(_recording, "rec", None)
    if rec is not None:
        rec.mapped(desc, x.data.ptr, *shape)
    return desc


def _backward_sm90(p, q, k, v, dout, dk, dv, spec, block_mask, deterministic, rows, packed, done, ready,
                   preprocess):
    """Launch ``preprocess`` and then the Hopper dK/dV pass of ``rows`` queries per step
    (``sm90_bwd_rows``), its programmatic dependent, with nothing queued between them (the
    block lists and the deterministic counters are made first); ``done``: where its blocks
    count themselves finished per (batch, kv head), or 0; ``ready``: the flags of the
    preprocess beside the pass (``preprocess_beside``), or 0. Returns its blocks per (batch,
    kv head) (key tiles)."""
    b, sq, sk = _dims(q, k, packed)
    h, hk = q.shape[2], k.shape[2]
    hd = sm90_bwd_headdim(spec.headdim)
    keys = sm90_bwd_keys(hd)
    if block_mask is not None:
        _fill_lists(p, block_mask, rows, keys, spec.causal, kv=False, q=True)
    _check_lists(p, "q_blocks", keys, rows)
    # K, V, two stages of Q and dO (`rows` rows); keys x rows tiles of dS^T, two steps', or 64
    # x 64 of P^T and dS^T (wide), two steps'; eight warps' fp32 dQ stages (16 rows x the
    # warpgroup's dQ columns: hd at 128 rows, else hd / 2; 16 columns x 80 queries at 80 rows;
    # none wide, whose stages are in Q and dO's tiles); 1 KB to align.
    dq_cols = 0 if hd == 256 else hd if rows == 128 else rows if rows == 80 else hd // 2
    tiles_kq = 4 if hd == 256 else 2
    smem = (2 * keys + 4 * rows) * hd * 2 + tiles_kq * keys * rows * 2 + 8 * 16 * dq_cols * 4 + 1024
    tp = np.zeros((), BWD_SM90_PARAMS)
    tiles = _config.cdiv(sk, keys)
    # What a (kv head, batch) pair's blocks all read: its query heads' Q, dO and fp32 dQ.
    pair_bytes = sq * (h // hk) * (q.shape[3] * q.itemsize + dout.shape[3] * dout.itemsize + q.shape[3] * 4)
    grid = _tile_grid(p, tiles, hk, b, spec.causal or sm90_grouped(spec, block_mask, backward=True), pair_bytes)
    tp["base"] = p
    tp["dq_done"] = done
    tp["ready"] = ready
    if deterministic:
        order = zeros((b, h, _config.cdiv(sq, 64)), np.int32)   # per 64 rows
        tp["dq_order"] = order.data.ptr
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout), ("dk", dk), ("dv", dv)):
        tp[name] = _row_map(x, spec.dtype, rows if name in ("q", "dout") else 64)
    # The preprocess's programmatic dependent: its blocks take the SMs that the preprocess's
    # last wave leaves and start their copies (cuda/bwd_sm90.cu).
    preprocess(tiles, tp)
    _launch("bwd_sm90.cu", _bwd_sm90_name(spec, hd, rows), grid, SM90_BWD_THREADS, smem, tp[()], spec.user_mods,
            dependent=True)
    return tiles


def sm90_fwd_l2_part(hd):
    """The share of the L2 (1 / this) that the Hopper forward's causal launch groups fill
    (``_launch_group``): all of it where the kernel is persistent (head dim <= 128), half
    above, where it takes a block per tile: measured on the H200 0.2-2.0% faster at d=256
    causal 2K-16K than groups that fill it, slower with a quarter, and 1% slower at d=64
    (benchmarks/NOTES.md, thirtieth session)."""
    return 2 if hd > 128 else 1


def sm90_fwd_strided(spec, block_mask, seqlen_k):
    """Whether the Hopper forward above head dim 128 runs persistent blocks with a static
    stride (cuda/fwd_sm90.cu's ``Strided``): calls whose tiles take about alike long, not
    causal, without packed rows, a mask_mod or a block mask (whose lists make tiles unequal:
    one block a tile there). A window only where both its sides are bounded and span at most
    an eighth of the keys: the tiles along its ramps see fewer keys, and a stride of the SM
    count can hand one block only long tiles (window (4096, 0) at 8K ran 14.9% slower strided,
    (1024, 0) 3.1% faster; H200, benchmarks/NOTES.md). Not a bf16 window with softcap alone
    (the kernel whose tensor cores sum P, ``OnesSum``, spilled strided under NVRTC 13.0)."""
    if spec.local:
        left, right = spec.window
        if left < 0 or right < 0 or 8 * (left + right) > seqlen_k or _softcap_alone_bf16(spec):
            return False
    return (sm90_headdim(spec.headdim) > 128 and not spec.causal and not spec.varlen
            and not spec.mask_mod and block_mask is None)


def sm90_grouped(spec, block_mask, backward=False):
    """Whether a Hopper pass draws a mask_mod's tiles in launch groups, longest first
    (``_tile_grid``), as a causal call's: in the forward where its block mask's later rows
    never see fewer blocks than earlier ones, in every head, and some see more (a mask_mod
    spelling causal or prefix-LM); in the dK/dV pass where its later key blocks are never seen
    by more rows and some by fewer. Drawn in order, head after head, such a mask's last heads'
    longest tiles ran alone at the end (benchmarks/NOTES.md, thirty-ninth session). Only the
    mask_mod kernels decode launch groups without the causal flag: in the others that cost 1-3%."""
    if not spec.mask_mod or block_mask is None:
        return False
    return block_mask._cols_shrink if backward else block_mask._rows_grow


def _forward_sm90(p, q, k, v, out, spec, block_mask, packed=None):
    b, sq, sk = _dims(q, k, packed)
    h = q.shape[2]
    hd = sm90_headdim(spec.headdim)
    groups, keys = sm90_fwd_call_tile(spec, block_mask)
    rows = 64 * groups
    if block_mask is not None:
        _fill_lists(p, block_mask, rows, keys, spec.causal, kv=True, q=False)
    _check_lists(p, "kv_blocks", rows, keys)
    tp = np.zeros((), FWD_SM90_PARAMS)
    # What a (head, batch) pair's tiles all read: K and V.
    pair_bytes = sk * (k.shape[3] * k.itemsize + v.shape[3] * v.itemsize)
    tp["grid"] = _tile_grid(p, _config.cdiv(sq, rows), h, b, spec.causal or sm90_grouped(spec, block_mask),
                            pair_bytes, sm90_fwd_l2_part(hd))
    tp["base"] = p
    for name, x in (("q", q), ("k", k), ("v", v), ("o", out)):
        tp[name] = _row_map(x, spec.dtype, keys if name in ("k", "v") else 64)
    # Persistent (hd <= 128, cuda/fwd_sm90.cu): one block per SM at most, each taking tiles
    # of the grid from the counter; strided above 128 (``sm90_fwd_strided``): as many, each
    # taking every SM count-th tile; else one block per tile.
    blocks = int(np.prod(tp["grid"], dtype=np.int64))
    if hd <= 128:
        counter = zeros((), np.int32)
        tp["counter"] = counter.data.ptr
    if hd <= 128 or sm90_fwd_strided(spec, block_mask, sk):
        blocks = min(blocks, _sm_count())
    name = _sm90_fwd_name(spec, hd, groups, keys)
    _launch("fwd_sm90.cu", name, (blocks, 1, 1), 128 * (groups + 1), sm90_fwd_smem(hd, groups, keys),
            tp[()], spec.user_mods)


def forward(q, k, v, out, lse, scale, spec, block_mask=None, alibi_slopes=None, dropout=None,
            user_arrays=(), packed=None):
    """Launch the forward pass of the call ``spec`` (a CallSpec). ``out`` and ``lse`` are
    preallocated outputs; ``dropout`` the (seed, offset) of a spec with dropout;
    ``user_arrays`` those of its user mods (``_fill_user``); ``packed``: the Packed batch of a
    spec with varlen, whose q, k, v and out come as (1, total, nheads, headdim). Through the
    plan of its signature (``_planned``), except with a block mask (whose lists are its own) or
    dropout (whose offset changes at every step of a training loop)."""
    arrays = (q, k, v, out, lse, alibi_slopes, *_packed_arrays(packed), *user_arrays)
    _planned(lambda: _forward(q, k, v, out, lse, scale, spec, block_mask, alibi_slopes, dropout, user_arrays,
                              packed),
             arrays, ("fwd", spec, scale, _packed_maxima(packed)), block_mask is None and not spec.dropout)


def _packed_arrays(packed):
    return (packed.cu_seqlens_q, packed.cu_seqlens_k) if packed is not None else (None, None)


def _packed_maxima(packed):
    return (packed.max_seqlen_q, packed.max_seqlen_k) if packed is not None else None


def _forward(q, k, v, out, lse, scale, spec, block_mask, alibi_slopes, dropout, user_arrays, packed):
    p = np.zeros((), FWD_PARAMS)
    _fill_user(p["user"], user_arrays)
    for name, a in (("q", q), ("k", k), ("v", v), ("o", out)):
        _tensor_ref(p[name], a)
    p["lse"] = lse.data.ptr
    _fill_dims(p, q, k, scale, spec, alibi_slopes, dropout, packed)
    p["vec_ok"] = _vec_ok(q, k, v, out)
    b, sq, _ = _dims(q, k, packed)
    h = q.shape[2]
    hd, elem = spec.headdim, ELEM[spec.dtype]
    if kernel_family(spec, block_mask, q, k, v) == "sm90":
        _forward_sm90(p, q, k, v, out, spec, block_mask, packed)
    elif spec.dtype in TENSOR_CORE:
        def name_of(t):
            return "fwd.cu", fwd_name(spec, elem, hd, t), t.smem_bytes(hd, spec.masked_band)
        t = _pass_tile("fwd", spec, _smem_limit(), block_mask, name_of)
        if block_mask is not None:
            _fill_lists(p, block_mask, t.br, t.bc, spec.causal, kv=True, q=False)
        _check_lists(p, "kv_blocks", t.br, t.bc)
        _, name, smem = name_of(t)
        _launch("fwd.cu", name, _tile_grid(p, _config.cdiv(sq, t.br), h, b, spec.causal),
                32 * t.warps, smem, p[()], spec.user_mods)
    else:
        if block_mask is not None:
            _fill_lists(p, block_mask, block_mask.block_q, block_mask.block_k, spec.causal,
                        kv=True, q=False)
        name = template_name("generic_fwd_kernel", elem, hd, spec.variant(band_at_run_time=True))
        _launch("generic.cu", name, (_config.cdiv(sq, _config.GENERIC_WARPS), h, b),
                32 * _config.GENERIC_WARPS, _generic_smem(hd, q.itemsize), p[()], spec.user_mods)


def backward(dout, q, k, v, out, lse, dq, dk, dv, stats, dq_accum, scale, spec, block_mask=None,
             alibi_slopes=None, dropout=None, user_arrays=(), user_grads=None,
             deterministic=False, packed=None):
    """Launch the backward passes of the call ``spec``. ``dq``, ``dk``, ``dv`` and ``stats``
    (D and lse in log2 units, ``(2,) + lse.shape`` in lse's dtype, written by the first pass)
    are preallocated; ``dq_accum`` is a zeroed fp32 buffer of ``dq_accum_shape(q.shape,
    packed)``, or None (the deterministic generic pass, the plain path). ``deterministic``
    with a ``dq_accum``: the Hopper pass, adding dQ in key order (``bwd_family``).
    ``packed`` as for ``forward``; through a plan as ``forward``."""
    grads = sorted((user_grads or {}).items())
    arrays = (dout, q, k, v, out, lse, dq, dk, dv, stats, dq_accum, alibi_slopes, *_packed_arrays(packed),
              *user_arrays, *(g for _, g in grads))
    _planned(lambda: _backward(dout, q, k, v, out, lse, dq, dk, dv, stats, dq_accum, scale, spec, block_mask,
                               alibi_slopes, dropout, user_arrays, user_grads, deterministic, packed),
             arrays, ("bwd", spec, scale, _packed_maxima(packed), deterministic, tuple(slot for slot, _ in grads)),
             block_mask is None and not spec.dropout)


def _backward(dout, q, k, v, out, lse, dq, dk, dv, stats, dq_accum, scale, spec, block_mask, alibi_slopes,
              dropout, user_arrays, user_grads, deterministic, packed):
    p = np.zeros((), BWD_PARAMS)
    _fill_user(p["user"], user_arrays, user_grads)
    for name, a in (("q", q), ("k", k), ("v", v), ("o", out), ("dout", dout),
                    ("dq", dq), ("dk", dk), ("dv", dv)):
        _tensor_ref(p[name], a)
    p["lse"], p["dsum"], p["lse_log2"] = lse.data.ptr, stats[0].data.ptr, stats[1].data.ptr
    if dq_accum is not None:
        p["dq_accum"] = dq_accum.data.ptr
        p["dq_accum_rows"], p["dq_accum_cols"] = dq_accum.shape[2:]
    _fill_dims(p, q, k, scale, spec, alibi_slopes, dropout, packed)
    p["vec_ok"] = _vec_ok(q, k, v, out, dout, dq, dk, dv)
    b, sq, sk = _dims(q, k, packed)
    h, hk = q.shape[2], k.shape[2]
    hd, elem = spec.headdim, ELEM[spec.dtype]
    causal = spec.causal
    varlen = (str(_spec.SEQ_PACKED),) if spec.varlen else ()
    hopper = bwd_family(spec, block_mask, q, k, v, out, dout, dq, dk, dv,
                        deterministic=deterministic) == "sm90"
    hopper_pass = dq_accum is not None and hopper
    overlap = hopper_pass and convert_overlaps(spec, block_mask)
    step = sm90_bwd_step(spec, block_mask, deterministic, sq) if hopper else 0
    beside = hopper_pass and preprocess_beside(spec, step, block_mask)
    done = np.uint64(0)   # the counts of finished pass blocks (zeroed by the preprocess)
    ready = np.uint64(0)  # the preprocess beside the pass: its units' flags, then the counts
    if beside:
        units = b * h * _config.cdiv(sq, PREPROCESS_ROWS)
        flags = zeros(units + (b * hk if overlap else 0), np.int32)
        ready = np.uint64(flags.data.ptr)
        if overlap:
            done = np.uint64(flags.data.ptr + 4 * units)
    elif overlap:
        counts = empty(b * hk, np.int32)
        done = np.uint64(counts.data.ptr)
    strips = dq_accum is not None and step == 80   # the buffer in cuda/bwd.cu's DQ_STRIPS
    def preprocess(tiles=0, tp=None):
        if beside:
            _preprocess_beside(p, ready, spec, out, tp, tiles)
        else:
            _launch("bwd.cu", template_name("bwd_preprocess_kernel", elem, *varlen),
                    (_config.cdiv(sq, PREPROCESS_ROWS), h, b), PREPROCESS_THREADS, 0, (p[()], done, np.int32(strips)))
    if deterministic and (dq_accum is not None) != hopper:
        raise AssertionError("deterministic: a dq_accum is for the Hopper pass only")
    if not hopper_pass:   # the Hopper pass launches it right before itself (_backward_sm90)
        preprocess()
    if hopper_pass:
        # The 80-row kernel clips its adds to the 16-row tiles that hold rows; the others add
        # whole steps.
        if (dq_accum.shape != dq_accum_shape(q.shape, packed) or dq_accum.shape[2] % (16 if step == 80 else step)
                or dq_accum.shape[3] != hd):
            raise AssertionError(f"dq_accum {dq_accum.shape}: the Hopper pass adds {step}-row "
                                 f"tiles of {hd} columns")
        tiles = _backward_sm90(p, q, k, v, dout, dk, dv, spec, block_mask, deterministic, step, packed, done,
                               ready, preprocess)
        # At 16K tokens x 2048 it reads 128 MiB (~60 us on the H200, 4% of a d=128 2K
        # backward), and the pass's last wave leaves SMs idle. The 80-row pass's column strips
        # are read through 16 rows of shared memory.
        layout, strip = (DQ_STRIPS, 16 * (hd + 1) * 4) if strips else (DQ_LANES, 0)
        _launch("bwd.cu", template_name("bwd_convert_dq_kernel", elem, layout, *varlen), (_config.cdiv(sq, 16), h, b),
                DQ_CONVERT_THREADS, strip, (p[()], done, np.int32(tiles), ready), dependent=True)
    elif spec.dtype in TENSOR_CORE:
        limit = _smem_limit()
        def name_of(t):
            return "bwd.cu", bwd_dkdv_name(spec, elem, hd, t, dq_accum is not None), t.smem_bytes(hd)
        t = _pass_tile("bwd", spec, limit, block_mask, name_of, deterministic=dq_accum is None)
        if dq_accum is not None:
            # The dK/dV kernel adds whole tiles of t.br rows x the head-dim bucket, unchecked.
            rows, cols = dq_accum.shape[2:]
            if dq_accum.shape != dq_accum_shape(q.shape, packed) or rows % t.br or cols != hd:
                raise AssertionError(f"dq_accum {dq_accum.shape}: the kernel adds {t.br}-row "
                                     f"tiles of {hd} columns for (batch, seqlen_q, nheads) = "
                                     f"{(b, sq, h)}")
        if block_mask is not None:
            _fill_lists(p, block_mask, t.br, t.bc, causal, kv=False, q=True)
        _check_lists(p, "q_blocks", t.bc, t.br)
        _, name, smem = name_of(t)
        _launch("bwd.cu", name, _tile_grid(p, _config.cdiv(sk, t.bc), hk, b, causal), 32 * t.warps,
                smem, p[()], spec.user_mods)
        if dq_accum is None:
            def name_of(t):
                return "bwd.cu", bwd_dq_name(spec, elem, hd, t), t.smem_bytes(hd)
            t = _pass_tile("dq", spec, limit, block_mask, name_of)
            if block_mask is not None:
                _fill_lists(p, block_mask, t.br, t.bc, causal, kv=True, q=False)
            _check_lists(p, "kv_blocks", t.br, t.bc)
            _, name, smem = name_of(t)
            _launch("bwd.cu", name, _tile_grid(p, _config.cdiv(sq, t.br), h, b, causal), 32 * t.warps,
                    smem, p[()], spec.user_mods)
        else:
            _launch("bwd.cu", template_name("bwd_convert_dq_kernel", elem, DQ_MMA, *varlen),
                    (_config.cdiv(sq, 16), h, b), DQ_CONVERT_THREADS, 16 * (dq_accum.shape[3] + 1) * 4,
                    (p[()], done, np.int32(0), np.uint64(0)))
    else:
        if block_mask is not None:
            _fill_lists(p, block_mask, block_mask.block_q, block_mask.block_k, causal, kv=True, q=True)
        smem = _generic_smem(hd, q.itemsize)
        threads = 32 * _config.GENERIC_WARPS
        variant = spec.variant(band_at_run_time=True)
        _launch("generic.cu", template_name("generic_bwd_dq_kernel", elem, hd, variant),
                (_config.cdiv(sq, _config.GENERIC_WARPS), h, b), threads, smem, p[()], spec.user_mods)
        _launch("generic.cu", template_name("generic_bwd_dkdv_kernel", elem, hd, variant),
                (_config.cdiv(sk, _config.GENERIC_WARPS), hk, b), threads, smem, p[()],
                spec.user_mods)


def fwd_name(spec, elem, hd, t):
    """cuda/fwd.cu's kernel for ``spec`` at head-dim bucket ``hd``, tile ``t``."""
    return template_name("flash_fwd_kernel", elem, hd, t.br, t.bc, t.warps, t.stages_for(spec.masked_band),
                         spec.variant())


def bwd_dkdv_name(spec, elem, hd, t, atomic_dq):
    """cuda/bwd.cu's dK/dV kernel for ``spec`` at head-dim bucket ``hd``, tile ``t``, adding dQ
    into the fp32 buffer (``atomic_dq``) or not: the deterministic mode's kernels, as its dQ
    pass's, read every band at run time."""
    return template_name("flash_bwd_dkdv_kernel", elem, hd, t.bc, t.br, t.warps, t.km, t.stages,
                         spec.variant(band_at_run_time=not atomic_dq), atomic_dq)


def bwd_dq_name(spec, elem, hd, t):
    """cuda/bwd.cu's deterministic dQ kernel: every band read at run time."""
    return template_name("flash_bwd_dq_kernel", elem, hd, t.br, t.bc, t.warps,
                         spec.variant(band_at_run_time=True))


# cuda/decode.cu: four warps, 16-key slices, splits of whole 64-key steps, at most 128 of them;
# the merge kernel's threads: 8 groups of a quarter of the head dim.
DECODE_THREADS, DECODE_KEYS, DECODE_MAX_SPLITS, DECODE_MERGE_GROUPS = 128, 64, 128, 8
DECODE_PARAMS = np.dtype({"names": ["base", "o_part", "lse_part", "splits", "split_keys", "row_chunks", "stream_keys"],
                          "formats": [FWD_PARAMS, np.uint64, np.uint64, np.int32, np.int32, np.int32, np.int32],
                          "offsets": [0] + [_config.cdiv(FWD_PARAMS.itemsize, 8) * 8 + o for o in (0, 8, 16, 20, 24, 28)],
                          "itemsize": _config.cdiv(FWD_PARAMS.itemsize, 8) * 8 + 32})


def decode_smem(hd):
    """cuda/decode.cu's decode_smem: Q (16 rows) and four warps' rings of K and V slices (16
    rows each; three stages up to head dim 128, two above), rows padded by SMEM_PAD."""
    stages = 3 if hd <= 128 else 2
    return (16 + 4 * stages * 2 * 16) * (hd + _config.SMEM_PAD) * 2


def decode_supported(spec, q, k_cache, v_cache, k=None, v=None):
    """The decode kernels (cuda/decode.cu) run this call: fp16/bf16 with 16-byte aligned rows;
    else the cache is gathered and flash_attention_varlen runs (cupyflash/kvcache.py)."""
    arrays = [a for a in (q, k_cache, v_cache, k, v) if a is not None]
    return spec.dtype in TENSOR_CORE and _vec_ok(*arrays)


@functools.lru_cache(maxsize=1024)   # a decoding loop asks again with the same numbers
def decode_splits(blocks, max_keys, slots, requested=0):
    """Splits of each entry's keys: ``requested``, or the fewest whose blocks fill the GPU's
    ``slots`` (SMs x blocks per SM) in waves at least 95% full, else the count that fills them
    best (each split at least one 64-key step; counts that give the same keys per split as a
    smaller one skipped). Measured on the H200 at batch 1: 29 splits (232 of 264 slots) ran
    4-5% slower than 32 (256), 16 (one wave of one block per SM) as fast as 32 for contiguous
    caches but 10% slower for paged ones (benchmarks/NOTES.md). At most
    DECODE_MAX_SPLITS either way (the merge kernel's shared memory)."""
    steps = max(1, _config.cdiv(max_keys, DECODE_KEYS))
    most = min(steps, DECODE_MAX_SPLITS)
    if requested:
        return min(requested, most)
    if blocks >= 0.8 * slots:
        return 1
    def efficiency(n):
        waves = blocks * n / slots
        return waves / math.ceil(waves)
    counts = [n for n in range(1, most + 1)
              if n == 1 or _config.cdiv(steps, n) != _config.cdiv(steps, n - 1)]
    full = [n for n in counts if efficiency(n) >= 0.95]
    return full[0] if full else max(counts, key=efficiency)


def kvcache_append(k_cache, v_cache, k, v, layout):
    """cuda/decode.cu's kvcache_append_kernel: the new keys and values into the caches."""
    p = np.zeros((), FWD_PARAMS)
    for name, a in (("q", k), ("o", v), ("k", k_cache), ("v", v_cache)):
        _tensor_ref(p[name], a)
    p["headdim"] = k.shape[3]
    _fill_dims(p, k, k_cache, 1.0, _spec.CallSpec(k.dtype.name, 0), None, None, layout)
    storage = {2: "u16", 4: "float", 8: "double"}[k.itemsize]
    seq = _spec.SEQ_PAGED if layout.block_table is not None else _spec.SEQ_CACHE
    _launch("decode.cu", template_name("kvcache_append_kernel", storage, seq), (k.shape[1], k.shape[2], k.shape[0]),
            DECODE_THREADS, 0, p[()])


def decode(q, k_cache, v_cache, out, lse, scale, spec, alibi_slopes, layout, num_splits=0):
    """cuda/decode.cu's flash_decode_kernel over the cache ``layout`` (a Cache), with split-KV
    and flash_decode_merge_kernel when more than one split runs. (Not through a plan: its
    preparation is short, measured no faster planned, and the longest entry, which sizes its
    grid, grows at every step of a decoding loop.)"""
    import cupy
    p = np.zeros((), DECODE_PARAMS)
    base = p["base"]
    for name, a in (("q", q), ("k", k_cache), ("v", v_cache), ("o", out)):
        _tensor_ref(base[name], a)
    base["lse"] = lse.data.ptr
    _fill_dims(base, q, k_cache, scale, spec, alibi_slopes, None, layout)
    b, sq, h, _ = q.shape
    hk, hd = k_cache.shape[2], spec.headdim
    chunks = _config.cdiv(h // hk * sq, 16)
    smem = decode_smem(hd)
    blocks = b * hk * chunks
    splits = decode_splits(blocks, layout.max_keys, _sm_count() * max(1, _smem_limit() // smem), num_splits)
    split_keys = _config.cdiv(_config.cdiv(max(layout.max_keys, 1), splits), DECODE_KEYS) * DECODE_KEYS
    splits = max(1, _config.cdiv(layout.max_keys, split_keys))
    p["splits"], p["split_keys"], p["row_chunks"] = splits, split_keys, chunks
    # K and V of every entry at a length from which they outsize the L2 (decode.cu's stream_keys).
    p["stream_keys"] = min(_config.cdiv(_device_attribute("L2CacheSize"), 2 * b * hk * hd * k_cache.itemsize), 2**31 - 1)
    if splits > 1:
        o_part = empty((splits, b, h, sq, hd), cupy.float32)
        lse_part = empty((splits, b, h, sq), cupy.float32)
        p["o_part"], p["lse_part"] = o_part.data.ptr, lse_part.data.ptr
    elem, variant = ELEM[spec.dtype], spec.variant()
    _launch("decode.cu", template_name("flash_decode_kernel", elem, hd, variant), (splits, hk * chunks, b),
            DECODE_THREADS, smem, p[()])
    if splits > 1:
        _launch("decode.cu", template_name("flash_decode_merge_kernel", elem, hd), (sq, h, b),
                DECODE_MERGE_GROUPS * hd // 4, 0, p[()],
                dependent=int(cupy.cuda.Device().compute_capability) >= 90)


def dq_buffer(spec, block_mask, deterministic, q, k, v, out, dout, dq, dk, dv, packed=None):
    """The fp32 dQ buffer (``dq_accum_shape``) the backward of this call adds into, or None:
    dQ is added up in it in any order, or in key order where the Hopper pass runs
    deterministic=True (else dQ has a pass of its own), and the plain kernels take none.
    Uninitialized: ``backward``'s preprocess kernel zeroes the tiles the passes read."""
    import cupy
    if spec.dtype not in TENSOR_CORE or (deterministic and bwd_family(
            spec, block_mask, q, k, v, out, dout, dq, dk, dv, deterministic=True) != "sm90"):
        return None
    return cupy.empty(dq_accum_shape(q.shape, packed), cupy.float32)


def dq_accum_shape(shape, packed=None):
    """The fp32 dQ buffer of the atomic backward, (batch, nheads, rows, cols) floats in the
    tile order of bwd.cu: seqlen rounded up to whole mask blocks (every tile size divides
    them) and the head dim up to its bucket, so that the kernels add whole tiles without
    bounds checks. A packed batch's ``shape`` is (1, total_q, nheads, headdim): its sequences
    take slices that start at multiples of VARLEN_ACCUM_ALIGN rows (cuda/seqinfo.cuh), one
    after another, (total_q // align + batch) * align rows for all."""
    b, sq, h, d = shape
    if packed is not None:
        align = VARLEN_ACCUM_ALIGN
        return (1, h, (sq // align + packed.batch) * align, _config.head_dim_bucket(d))
    return (b, h, _config.cdiv(sq, _config.MAX_BLOCK) * _config.MAX_BLOCK, _config.head_dim_bucket(d))


def kernel_names(smem_limit, hopper=False):
    """{source file: [template names]} of every kernel the config table can pick on a device
    with ``smem_limit`` bytes of shared memory per block (for warm-up and compile checks);
    ``hopper``: an sm_90 device, which also runs the Hopper kernels (``kernel_family``)."""
    names = {"fwd.cu": [], "bwd.cu": [], "generic.cu": [], "fwd_sm90.cu": [], "bwd_sm90.cu": [], "decode.cu": []}
    variants = [_spec.CallSpec("float16", 0, window=w, softcap=cap, alibi=alibi, dropout=drop)
                for w in (_spec.NO_WINDOW, _spec.CAUSAL, (1, 1))
                for cap, alibi, drop in ((0.0, False, 0.0), (1.0, False, 0.0), (0.0, True, 0.0),
                                         (1.0, True, 0.0), (0.0, False, 0.5))]
    # Packed batches (varlen): every variant again, with no block mask.
    variants += [dataclasses.replace(s, seq=_spec.SEQ_PACKED) for s in variants]
    if hopper:
        # Each call's tile, without a block mask and with one (any mask: the rules ask only
        # whether there is one).
        names["fwd_sm90.cu"] = [
            _sm90_fwd_name(spec, hd, *tile)
            for d in TENSOR_CORE for hd in sorted({sm90_headdim(b) for b in _config.HEAD_DIM_BUCKETS})
            for spec in (dataclasses.replace(s, dtype=d, headdim=hd) for s in variants if not s.dropout)
            for tile in sorted({sm90_fwd_tile(spec, None)} | ({sm90_fwd_tile(spec, "mask")} if not spec.varlen else set()))]
        names["bwd_sm90.cu"] = [
            _bwd_sm90_name(spec, hd, rows)
            for d in TENSOR_CORE for hd in (64, 128, 256)
            for spec in (dataclasses.replace(s, dtype=d, headdim=hd) for s in variants if not s.dropout)
            for rows in sm90_bwd_rows_of_variant(hd, spec)] + [
            template_name("bwd_preprocess_beside_kernel", ELEM[d]) for d in TENSOR_CORE]
    # The decode kernels: every band with softcap and ALiBi (no dropout), both cache layouts.
    names["decode.cu"] = [
        template_name("flash_decode_kernel", ELEM[d], hd, dataclasses.replace(s, seq=seq).variant())
        for d in TENSOR_CORE for hd in _config.HEAD_DIM_BUCKETS for seq in (_spec.SEQ_CACHE, _spec.SEQ_PAGED)
        for s in variants if not s.dropout and s.seq == _spec.SEQ_DENSE] + [
        template_name("flash_decode_merge_kernel", ELEM[d], hd) for d in TENSOR_CORE for hd in _config.HEAD_DIM_BUCKETS] + [
        template_name("kvcache_append_kernel", storage, seq) for storage in ("u16", "float", "double")
        for seq in (_spec.SEQ_CACHE, _spec.SEQ_PAGED)]
    for elem in ELEM.values():
        names["bwd.cu"] += [template_name("bwd_preprocess_kernel", elem, *seq) for seq in ((), (_spec.SEQ_PACKED,))]
    for elem in (ELEM[d] for d in TENSOR_CORE):
        names["bwd.cu"] += [template_name("bwd_convert_dq_kernel", elem, layout, *seq)
                            for layout in (DQ_MMA, DQ_LANES, DQ_STRIPS) for seq in ((), (_spec.SEQ_PACKED,))]
    every = [(bq, bk) for bq in _config.MASK_BLOCK_SIZES for bk in _config.MASK_BLOCK_SIZES]
    dense = [(_config.MAX_BLOCK, _config.MAX_BLOCK)]   # the tiles of dense calls
    # Every band with every score modifier (softcap, ALiBi, both) and with dropout (alone: not
    # yet with a modifier, check_supported); a window is refused with a block mask, so its
    # kernels need only the dense tiles.
    # Packed batches take no block mask: the dense tiles.
    limits_of = {_spec.NO_WINDOW: every, _spec.CAUSAL: every}
    for hd in _config.HEAD_DIM_BUCKETS:
        for spec in variants:
            limits = dense if spec.varlen else limits_of.get(spec.window, dense)
            ex = spec.extras
            fwd = {_config.tile("fwd", hd, smem_limit, *lim, extras=ex) for lim in limits}
            bwd = {(_config.tile("bwd", hd, smem_limit, *lim, deterministic=not atomic,
                                 extras=ex), atomic)
                   for lim in limits for atomic in (False, True)}
            dq = {_config.tile("dq", hd, smem_limit, *lim, extras=ex) for lim in limits}
            for elem in (ELEM[d] for d in TENSOR_CORE):
                names["fwd.cu"] += [fwd_name(spec, elem, hd, t) for t in sorted(fwd, key=repr)]
                names["bwd.cu"] += [bwd_dkdv_name(spec, elem, hd, t, atomic) for t, atomic in sorted(bwd, key=repr)]
                names["bwd.cu"] += [bwd_dq_name(spec, elem, hd, t) for t in sorted(dq, key=repr)]
            for elem in ("float", "double"):
                for kernel in ("generic_fwd_kernel", "generic_bwd_dq_kernel",
                               "generic_bwd_dkdv_kernel"):
                    names["generic.cu"].append(template_name(kernel, elem, hd,
                                                             spec.variant(band_at_run_time=True)))
    # Bands read at run time (the plain kernels', bwd.cu's) share instantiations: each name once.
    return {f: list(dict.fromkeys(ns)) for f, ns in names.items()}
