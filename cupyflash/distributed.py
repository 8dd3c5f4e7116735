"""Context parallelism: ring attention over ranks that each hold a shard of the sequence.

Each rank holds its shard of q, k and v (batch, seqlen_local, heads, headdim). The key/value
shards travel around the ring (rank r sends to r + 1 and receives from r - 1) while each rank
attends its queries to the shard in hand; the partial results are merged by their lse
(``merge_attention``'s rule, in float32, in place). The backward passes the key/value shards around
the same way, with their dK/dV accumulators (float32) travelling beside them, and ends with
each accumulator back at its owner.

Layouts (``layout``): ``"zigzag"`` (the default) cuts the sequence into 2W equal chunks and
gives rank r chunks r and 2W-1-r, so that under a causal mask every rank does the same work
at every step; ``"contiguous"`` gives rank r chunk r of W (a plain ring: under a causal mask
rank r idles while it holds a later shard). ``shard`` and ``unshard`` cut and join a full
sequence the same way.

Communication goes through an engine the caller already runs, behind one small adapter each
(``group``): a ``torch.distributed`` process group (NCCL; ``batch_isend_irecv``), a
``cupy.cuda.nccl.NcclCommunicator``, or ``LocalRing(size).member(rank)``: the ranks as threads
of one process, for tests and for trying the API on one device or on NumPy arrays. Anything
with ``rank``, ``size`` and ``start(sends, recvs) -> pending`` (``pending.wait()``) also works.
On a GPU the transfers run on a side stream and overlap the attention of the shard in hand;
``pending.wait()`` orders the caller's stream after them.
"""
import sys
import threading

import numpy as np

from . import _arrays, _config, _validate
from ._spec import CAUSAL, NO_WINDOW, band as _band
from .api import flash_attention, flash_attention_backward

LAYOUTS = ("zigzag", "contiguous")


# --- layouts ---------------------------------------------------------------------------------

def _per_rank(layout):
    """Chunks each rank holds: two (zigzag) or one (contiguous)."""
    _check_layout(layout)
    return 2 if layout == "zigzag" else 1


def chunks_of(rank, world, layout="zigzag"):
    """The global chunk indices rank ``rank`` of ``world`` holds, in sequence order: (r, 2W-1-r)
    of 2W chunks (zigzag) or (r,) of W (contiguous)."""
    return (rank, 2 * world - 1 - rank) if _per_rank(layout) == 2 else (rank,)


def shard(x, rank, world, *, axis=1, layout="zigzag"):
    """Rank ``rank``'s shard of the full sequence ``x`` (a NumPy or CuPy array or a torch
    tensor, the sequence along ``axis``): a new contiguous array of the same kind. The
    sequence length must divide into 2 * world (zigzag) or world (contiguous) equal chunks."""
    n = _per_rank(layout) * world
    if x.shape[axis] % n:
        raise ValueError(f"x: sequence length {x.shape[axis]} (axis {axis}) must be a multiple of "
                         f"{n} for the {layout} layout over {world} ranks")
    c = x.shape[axis] // n
    return _join([_rows(x, axis, i * c, c) for i in chunks_of(rank, world, layout)], axis)


def unshard(shards, *, axis=1, layout="zigzag"):
    """The full sequence from every rank's shard (``shards[r]`` from rank r), inverse of
    ``shard``."""
    world = len(shards)
    per = _per_rank(layout)
    c = shards[0].shape[axis] // per
    placed = [None] * (per * world)
    for r, s in enumerate(shards):
        for j, i in enumerate(chunks_of(r, world, layout)):
            placed[i] = _rows(s, axis, j * c, c)
    return _join(placed, axis)


def _rows(x, axis, start, n):
    return x[(slice(None),) * axis + (slice(start, start + n),)]


def _join(parts, axis):
    """Concatenated along ``axis`` into a new contiguous array of the parts' kind."""
    if _arrays.framework(parts[0]) == "torch":
        return sys.modules["torch"].cat(parts, dim=axis)
    return _xp(parts[0]).concatenate(parts, axis=axis)


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")


def _xp(x):
    return np if isinstance(x, np.ndarray) else _arrays._cupy()


# --- rings -----------------------------------------------------------------------------------

class LocalRing:
    """``size`` ranks as threads of one process: ``member(rank)`` is rank ``rank``'s group.
    Each exchange copies the buffers (NumPy, or CuPy on one device) from the previous rank's
    thread, between two barriers; nothing overlaps. For tests, and for trying ring attention
    without several GPUs. Not under PyTorch autograd with more than one rank on a device:
    PyTorch runs a device's backward passes on one engine thread, so the ranks' backwards
    would wait for each other there."""

    def __init__(self, size):
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self._sent = [None] * size
        self._barrier = threading.Barrier(size)

    def member(self, rank):
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {rank}")
        return _LocalMember(self, rank)


class _Done:
    def wait(self):
        pass


class _LocalMember:
    def __init__(self, ring, rank):
        self.ring, self.rank, self.size = ring, rank, ring.size

    def start(self, sends, recvs):
        xp = _xp(sends[0])
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
        self.ring._sent[self.rank] = sends
        self.ring._barrier.wait()
        for dst, src in zip(recvs, self.ring._sent[(self.rank - 1) % self.size]):
            xp.copyto(dst, src)
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
        self.ring._barrier.wait()
        return _Done()


class _StreamPending:
    def __init__(self, event):
        self.event = event

    def wait(self):
        _arrays._cupy().cuda.get_current_stream().wait_event(self.event)


class _NcclRing:
    """A ``cupy.cuda.nccl.NcclCommunicator``: sends and receives as bytes in one NCCL group
    on a side stream that first waits for the caller's stream."""

    def __init__(self, comm):
        cp = _arrays._cupy()
        self.comm, self.rank, self.size = comm, comm.rank_id(), comm.size()
        self.side = cp.cuda.Stream(non_blocking=True)

    def start(self, sends, recvs):
        cp = _arrays._cupy()
        from cupy.cuda import nccl
        self.side.wait_event(cp.cuda.get_current_stream().record())
        nccl.groupStart()
        for a in sends:
            self.comm.send(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, (self.rank + 1) % self.size, self.side.ptr)
        for a in recvs:
            self.comm.recv(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, (self.rank - 1) % self.size, self.side.ptr)
        nccl.groupEnd()
        return _StreamPending(self.side.record())


class _TorchRing:
    """A ``torch.distributed`` process group: ``batch_isend_irecv`` of byte views, issued with a
    side stream current (NCCL's own stream waits for it), waited on the caller's stream."""

    def __init__(self, group):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.group = torch, dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        # The peers as global ranks (P2POp's peer), from their ranks in the group.
        self.next, self.prev = ((r if group is None else dist.get_global_rank(group, r))
                                for r in ((self.rank + 1) % self.size, (self.rank - 1) % self.size))
        self.side = torch.cuda.Stream()

    def start(self, sends, recvs):
        torch, dist = self.torch, self.dist
        cp = _arrays._cupy()
        caller = torch.cuda.ExternalStream(cp.cuda.get_current_stream().ptr)
        self.side.wait_stream(caller)
        ops = ([dist.P2POp(dist.isend, self._bytes(a), self.next, self.group) for a in sends]
               + [dist.P2POp(dist.irecv, self._bytes(a), self.prev, self.group) for a in recvs])
        with torch.cuda.stream(self.side):
            requests = dist.batch_isend_irecv(ops)
        return _TorchPending(torch, requests, caller)

    def _bytes(self, a):
        return self.torch.from_dlpack(a.view(np.uint8).ravel())


class _TorchPending:
    def __init__(self, torch, requests, caller):
        self.torch, self.requests, self.caller = torch, requests, caller

    def wait(self):
        with self.torch.cuda.stream(self.caller):
            for r in self.requests:
                r.wait()


# Adapters by id() of their group, with the group itself (so that the id stays its own): one
# side stream per group for the process, not one per call. Not for None (torch's default
# group), which a re-initialized process group changes.
_adapters = {}


def as_ring(group):
    """The ring adapter of ``group``: a ``torch.distributed`` process group (None: the default
    group), a ``cupy.cuda.nccl.NcclCommunicator``, or an object with ``rank``, ``size`` and
    ``start`` (a ``LocalRing`` member) as it is."""
    if all(hasattr(group, a) for a in ("rank", "size", "start")):
        return group
    if id(group) in _adapters:
        return _adapters[id(group)][1]
    dist = sys.modules.get("torch.distributed")
    if type(group).__name__ == "NcclCommunicator":
        adapter = _NcclRing(group)
    elif dist is not None and (group is None or isinstance(group, dist.ProcessGroup)):
        adapter = _TorchRing(group)
    else:
        raise TypeError(f"group must be a torch.distributed ProcessGroup, a cupy.cuda.nccl."
                        f"NcclCommunicator or a LocalRing member, got {type(group).__name__}")
    if group is not None:
        _adapters[id(group)] = (group, adapter)
    return adapter


# --- ring attention --------------------------------------------------------------------------

def _plan(q_chunks, kv_chunks, c, band):
    """The calls of one step: (first q row, last q row + 1, first key, last key + 1, window)
    over the shards' rows, with ``band`` the (left, right) band of global positions
    (``_spec.band``: causal folded in). Without a window: a q chunk sees the held chunks
    before it whole and its own chunk up to the diagonal (one causal call over the prefix of
    the held shard that ends with it); neighbouring q chunks that see the same prefix whole
    share one call; holding its own chunks (the first step), a rank makes one causal call over
    its whole shard (the chunks are in sequence order on both sides, so local order is global
    order). With a window: one call per pair of chunks that the band reaches (``_pair``), a q
    chunk's own chunk first, so that each q chunk's first call covers all its rows."""
    if band not in (NO_WINDOW, CAUSAL):
        calls = []
        for j, qc in enumerate(q_chunks):
            for i in sorted(range(len(kv_chunks)), key=lambda i: kv_chunks[i] != qc):
                pair = _pair(qc, kv_chunks[i], c, band)
                if pair is not None:
                    qa, qb, a, b, window = pair
                    calls.append((j * c + qa, j * c + qb, i * c + a, i * c + b, window))
        return calls
    causal = band == CAUSAL
    if causal and tuple(q_chunks) == tuple(kv_chunks):
        return [(0, len(q_chunks) * c, 0, len(kv_chunks) * c, CAUSAL)]
    calls = []
    for j, qc in enumerate(q_chunks):
        if causal:
            seen = [i for i, kc in enumerate(kv_chunks) if kc <= qc]
            diagonal = qc in kv_chunks
        else:
            seen, diagonal = list(range(len(kv_chunks))), False
        if not seen:
            continue
        assert seen == list(range(len(seen))), "held chunks are in sequence order"
        call = [j * c, (j + 1) * c, 0, len(seen) * c, CAUSAL if diagonal else NO_WINDOW]
        if calls and not diagonal and calls[-1][4] == NO_WINDOW and calls[-1][1] == call[0] and calls[-1][3] == call[3]:
            calls[-1][1] = call[1]
        else:
            calls.append(call)
    return [tuple(x) for x in calls]


def _pair(qc, kc, c, band):
    """Rows [qa, qb) of q chunk ``qc`` and keys [a, b) of kv chunk ``kc`` (chunk-local, chunks of
    ``c`` rows) that ``band`` (left, right; -1 unbounded) lets see each other in global
    positions, and the window of one call over them that is that band: flash_attention aligns
    its window at the last row and key, which lie ``shift`` positions apart. None when no pair
    is visible. Every row of the range sees a key of it, so neither side of the window goes
    below 0; a side that hides nothing in the call is -1 (a causal or unmasked call)."""
    left, right = band
    d = (qc - kc) * c    # the q chunk's first position minus the kv chunk's
    far = abs(d) + 2 * c    # beyond every distance between the two chunks: an unbounded side
    lo, hi = (left if left >= 0 else far), (right if right >= 0 else far)
    qa, qb = max(0, -d - hi), min(c, c - d + lo)
    a, b = max(0, d + qa - lo), min(c, d + qb + hi)
    if qa >= qb or a >= b:
        return None
    shift = d + qb - b
    wl = -1 if left < 0 or left - shift >= b - a - 1 else left - shift
    wr = -1 if right < 0 or right + shift >= qb - qa - 1 else right + shift
    return qa, qb, a, b, (wl, wr)


def _accumulate(xp, out, lse, o, lse_o):
    """``out`` and ``lse`` (float views, updated in place): the attention over their keys and a
    disjoint set's whose result is ``o``, ``lse_o`` (merge_attention's rule, two parts at a
    time, with one temporary of o's size). Rows no key reached in either part stay 0, -inf; a
    NaN stays NaN."""
    total = xp.logaddexp(lse, lse_o)
    base = xp.where(xp.isneginf(total), 0, total)

    def weight(x):   # (batch, heads, rows) -> (batch, rows, heads, 1), as out's rows
        return xp.exp(x - base).transpose(0, 2, 1)[..., None]
    part = o.astype(out.dtype)
    part *= weight(lse_o)
    out *= weight(lse)
    out += part
    lse[...] = total


def _setup(names, arrays, group, layout, causal, window_size, head_groups):
    """The arrays on their backend, the caller, the array module, the ring, the chunk length,
    the band of global positions (``_spec.band``) and the head groups (``_head_groups``), each
    argument checked."""
    per = _per_rank(layout)
    band = _band(causal, _validate.check_window_size(window_size, None))
    converted, caller, xp = _arrays.as_backend(arrays, names)
    got = dict(zip(names, converted))
    q, k = got["q"], got["k"]
    for n in ("q", "k", "v"):
        if got[n].ndim != 4:
            raise ValueError(f"{n} must be (batch, seqlen_local, heads, headdim), got shape {tuple(got[n].shape)}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must be shards of the same sequence: q has {q.shape[1]} rows, k {k.shape[1]}")
    if q.shape[1] % per:
        raise ValueError(f"q: the zigzag layout holds two equal chunks per rank, so the local "
                         f"seqlen must be even, got {q.shape[1]} (shard cuts sequences whose "
                         f"length is a multiple of 2 * world; or use layout='contiguous')")
    if got["v"].shape[2] != k.shape[2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"k and v must have the same number of heads, dividing q's: q has "
                         f"{q.shape[2]}, k {k.shape[2]}, v {got['v'].shape[2]}")
    groups = _head_groups(q.shape[2], k.shape[2], k.nbytes, head_groups)
    ring = as_ring(group)
    return got, caller, xp, ring, q.shape[1] // per, band, groups


# The default head groups keep each group's k shard at least this big: a ring step then still
# sends tens of MiB per message, while its buffers shrink with the groups.
GROUP_BYTES = 64 << 20


def _head_groups(nheads, nheads_k, k_bytes, head_groups):
    """(query heads, KV heads) slices of each group: ``head_groups`` groups of nheads_k /
    head_groups KV heads, each with its KV heads' query heads (GQA puts a KV head's query
    heads side by side). None: the largest divisor of nheads_k whose groups' k shards are at
    least GROUP_BYTES, or 1."""
    if head_groups is None:
        head_groups = max([g for g in range(1, nheads_k + 1)
                           if nheads_k % g == 0 and k_bytes // g >= GROUP_BYTES], default=1)
    head_groups = _validate.check_int("head_groups", head_groups, 1, nheads_k)
    if nheads_k % head_groups:
        raise ValueError(f"head_groups must divide nheads_k ({nheads_k}), got {head_groups}")
    kv, per_kv = nheads_k // head_groups, nheads // nheads_k
    return [(slice(g * kv * per_kv, (g + 1) * kv * per_kv), slice(g * kv, (g + 1) * kv))
            for g in range(head_groups)]


def _ring_buffers(xp, first, world):
    """The shards in hand at each step: the caller's arrays first, then two buffers taking turns
    (one is received into while the other is read), never the caller's arrays."""
    first = [xp.ascontiguousarray(a) for a in first]    # sent as whole buffers
    spare = [[xp.empty_like(a) for a in first] for _ in range(min(2, world - 1))]
    return [first] + [spare[s % len(spare)] for s in range(world - 1)]


def ring_attention(q, k, v, group, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                   softcap=0.0, layout="zigzag", head_groups=None, return_lse=False):
    """``flash_attention`` over a sequence sharded across the ranks of ``group``.

    Parameters
    ----------
    q, k, v : this rank's shards (batch, seqlen_local, heads, headdim), k and v with nheads_k
        dividing q's heads (GQA); every rank's shards of one shape (``shard`` cuts them).
    group : a ``torch.distributed`` process group, a ``cupy.cuda.nccl.NcclCommunicator`` or a
        ``LocalRing`` member (``as_ring``).
    causal, softmax_scale, window_size, softcap : as for ``flash_attention``, over global
        positions (the whole sequence is square: the window is centred on the diagonal). Key
        shards that a window keeps out of reach of this rank's queries cost no call, but still
        travel the whole ring.
    layout : "zigzag" (default; seqlen_local even) or "contiguous", as ``shard`` cut them.
    head_groups : int, optional
        The heads go round the ring in this many groups, one group after another (a divisor
        of nheads_k; each group takes its KV heads' query heads). The buffers a ring needs
        besides its inputs and outputs (the received k/v shard, the float32 accumulators, the
        travelling dK/dV) are then a group's size, not the shard's. None: the most groups
        whose k shard is still ``GROUP_BYTES`` or more (1 for small shards). The same value
        must be given on every rank.

    Returns
    -------
    out (this rank's shard, q's dtype), or ``(out, lse)`` with lse (batch, heads, seqlen_local)
    float32 (float64 for float64 inputs).
    """
    got, caller, xp, ring, c, band, groups = _setup(["q", "k", "v"], [q, k, v], group, layout, causal,
                                                    window_size, head_groups)
    q, k, v = got["q"], got["k"], got["v"]
    with _arrays.launch_context(caller):
        out = xp.empty(q.shape, q.dtype)
        lse = xp.empty((q.shape[0], q.shape[2], q.shape[1]), _config.lse_dtype(q.dtype))
        for qs, ks in groups:
            out[:, :, qs] = _ring_forward(xp, ring, layout, c, band, q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                          lse[:, qs], softmax_scale=softmax_scale, softcap=softcap)
        out = _arrays.to_caller(out, caller)
        return (out, _arrays.to_caller(lse, caller)) if return_lse else out


def _ring_forward(xp, ring, layout, c, band, q, k, v, lse, **options):
    """One ring over q, k, v (one head group): out in the accumulators' dtype (lse's), ``lse``
    (a view) written in place."""
    out = xp.empty(q.shape, lse.dtype)
    mine = chunks_of(ring.rank, ring.size, layout)
    held = _ring_buffers(xp, [k, v], ring.size)
    written = 0   # the first step's rows below this were written; later calls merge into them
    for step in range(ring.size):
        pending = ring.start(held[step], held[step + 1]) if step + 1 < ring.size else None
        kh, vh = held[step]
        src = (ring.rank - step) % ring.size
        for q0, q1, k0, k1, window in _plan(mine, chunks_of(src, ring.size, layout), c, band):
            o, l = flash_attention(q[:, q0:q1], kh[:, k0:k1], vh[:, k0:k1], window_size=window,
                                   return_lse=True, **options)
            # The first step holds each q chunk's own chunk, whose call comes first among the
            # chunk's (the plan goes chunk by chunk) and covers every row of it (a row sees
            # itself): written, not merged.
            if step == 0 and q0 >= written:
                out[:, q0:q1], lse[:, :, q0:q1] = o, l
                written = q1
            else:
                _accumulate(xp, out[:, q0:q1], lse[:, :, q0:q1], o, l)
        if pending is not None:
            pending.wait()
    return out


def ring_attention_backward(dout, q, k, v, out, lse, group, *, causal=False, softmax_scale=None,
                            window_size=(-1, -1), softcap=0.0, layout="zigzag", head_groups=None):
    """Gradients of ``ring_attention``: (dq, dk, dv) of this rank's shards, in their dtypes.
    ``out`` and ``lse`` are this rank's results of the forward (``return_lse=True``); the other
    arguments as there (``head_groups`` need not be the forward's)."""
    names = ["dout", "q", "k", "v", "out", "lse"]
    got, caller, xp, ring, c, band, groups = _setup(names, [dout, q, k, v, out, lse], group, layout, causal,
                                                    window_size, head_groups)
    dout, q, k, v, out, lse = (got[n] for n in names)
    with _arrays.launch_context(caller):
        dq, dk, dv = xp.empty(q.shape, q.dtype), xp.empty(k.shape, k.dtype), xp.empty(v.shape, v.dtype)
        for qs, ks in groups:
            dq[:, :, qs], dk[:, :, ks], dv[:, :, ks] = _ring_backward(
                xp, ring, layout, c, band, dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                out[:, :, qs], lse[:, qs], softmax_scale=softmax_scale, softcap=softcap)
        return tuple(_arrays.to_caller(g, caller) for g in (dq, dk, dv))


def _ring_backward(xp, ring, layout, c, band, dout, q, k, v, out, lse, **options):
    """One ring's gradients (one head group): dq, dk, dv in the accumulators' dtype (lse's)."""
    acc = lse.dtype
    dq = xp.zeros(q.shape, acc)
    mine = chunks_of(ring.rank, ring.size, layout)
    held = _ring_buffers(xp, [k, v], ring.size)
    # dK/dV of the shard in hand travel with it; the step after the last brings each home.
    grads = [[xp.zeros(k.shape, acc), xp.zeros(v.shape, acc)] for _ in range(min(2, ring.size))]
    pending_grads = None
    for step in range(ring.size):
        pending = ring.start(held[step], held[step + 1]) if step + 1 < ring.size else None
        kh, vh = held[step]
        dk, dv = grads[step % len(grads)]
        src = (ring.rank - step) % ring.size
        parts = []
        for q0, q1, k0, k1, window in _plan(mine, chunks_of(src, ring.size, layout), c, band):
            parts.append((q0, q1, k0, k1) + tuple(flash_attention_backward(
                dout[:, q0:q1], q[:, q0:q1], kh[:, k0:k1], vh[:, k0:k1], out[:, q0:q1], lse[:, :, q0:q1],
                window_size=window, **options)))
        if pending_grads is not None:
            pending_grads.wait()    # this step's accumulators have arrived
        for q0, q1, k0, k1, gq, gk, gv in parts:
            dq[:, q0:q1] += gq.astype(acc)
            dk[:, k0:k1] += gk.astype(acc)
            dv[:, k0:k1] += gv.astype(acc)
        if ring.size > 1:
            nxt = grads[(step + 1) % len(grads)]
            pending_grads = ring.start([dk, dv], nxt)
        if pending is not None:
            pending.wait()
    if pending_grads is not None:
        pending_grads.wait()
    dk, dv = grads[ring.size % len(grads)]
    return dq, dk, dv
