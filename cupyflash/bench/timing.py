"""Timing and memory: CUDA events around each call after warm-up, the median over calls that
rotate among 3 input sets (so no call finds its inputs in L2). Each call is queued behind a spin
kernel just long enough to cover the time Python takes to queue it, so the GPU runs the call's
kernels back to back and the events time the GPU's work, not the launch overhead. Memory: the
peak device memory one call takes above what was held before it (inputs excluded; outputs,
saved tensors and scratch included): CuPy's pool through a MemoryHook, torch's allocator
through ``max_memory_allocated``.
"""
import functools
import statistics
import sys
import time

import numpy as np

from .cases import cp

SPIN_CYCLES_PER_MS = 2.2e6   # above any current GPU's SM clock: a spin lasts at least its ms
PROBE_SPIN_MS = 20.0         # GPU kept busy while the queueing time of one call is measured
MIN_SPIN_MS = 1.0            # the shortest spin queued before a timed call


# --- clocks: events, spin, peak memory ----------------------------------------------------

_SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


@functools.lru_cache(maxsize=None)
def _spin_kernel():
    return cp.RawKernel(_SPIN_SOURCE, "spin")


class CupyClock:
    """Events, spin kernel and peak memory for work on CuPy's current stream."""

    @staticmethod
    def event():
        e = cp.cuda.Event()
        e.record()
        return e

    @staticmethod
    def elapsed_ms(start, end):
        return cp.cuda.get_elapsed_time(start, end)

    @staticmethod
    def spin(ms):
        if ms > 0:
            _spin_kernel()((1,), (1,), (np.int64(ms * SPIN_CYCLES_PER_MS),))

    @staticmethod
    def synchronize():
        cp.cuda.get_current_stream().synchronize()

    def peak_bytes(self, fn):
        """Peak bytes held from CuPy's pool during ``fn()`` above what was held before."""
        class PoolPeak(cp.cuda.MemoryHook):
            name = "cupyflash_bench_peak"

            def __init__(self):
                super().__init__()
                self.sizes, self.current, self.peak = {}, 0, 0

            def malloc_postprocess(self, **kw):
                self.sizes[kw["mem_ptr"]] = kw["mem_size"]
                self.current += kw["mem_size"]
                self.peak = max(self.peak, self.current)

            def free_postprocess(self, **kw):
                self.current -= self.sizes.pop(kw["mem_ptr"], 0)

        hook = PoolPeak()
        with hook:
            result = fn()
            self.synchronize()
        del result
        return hook.peak


class TorchClock:
    """Events, spin kernel and peak memory for work on torch's current stream."""

    def __init__(self, torch):
        self.torch = torch

    def event(self):
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @staticmethod
    def elapsed_ms(start, end):
        return start.elapsed_time(end)

    def spin(self, ms):
        if ms > 0:
            self.torch.cuda._sleep(int(ms * SPIN_CYCLES_PER_MS))

    def synchronize(self):
        self.torch.cuda.synchronize()

    def peak_bytes(self, fn):
        """Peak bytes of torch's allocator during ``fn()`` above what was held before."""
        cuda = self.torch.cuda
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
        base = cuda.memory_allocated()
        result = fn()
        cuda.synchronize()
        del result
        return cuda.max_memory_allocated() - base


def release_memory():
    """Give cached device memory back (CuPy's pool, torch's cache) between cases."""
    if cp is not None:
        cp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# --- timing ---------------------------------------------------------------------------------

class Timing:
    """CUDA-event times of ``calls`` (one per input set, used in turn), one call per round.

    ``before()`` queues the spin, ``__call__`` times one call and waits for it: they are
    pytest-benchmark's setup and target (``benchmark.pedantic(timing, setup=timing.before,
    rounds=n, iterations=1)``); ``run(n)`` does the same without pytest.
    """

    def __init__(self, clock, calls):
        self.clock, self.calls = clock, list(calls)
        self.times, self.spin_ms, self.first_call_s, self._next = [], 0.0, None, 0

    def warm_up(self, n):
        t0 = time.perf_counter()
        self.calls[0]()
        self.clock.synchronize()
        self.first_call_s = time.perf_counter() - t0     # includes compiling, if any
        for i in range(1, max(n, 1)):
            self.calls[i % len(self.calls)]()
        # How long Python takes to queue a call, measured while the GPU is kept busy: the
        # slowest of one call per input set. A spin shorter than a call's queueing leaves the
        # GPU idle inside the timed window (seen on the H100: medians 2-3x the minimum in a few
        # cells with a spin of twice one probe), hence the wide margin.
        queue_ms = 0.0
        for call in self.calls:
            self.clock.spin(PROBE_SPIN_MS)
            t0 = time.perf_counter()
            call()
            queue_ms = max(queue_ms, 1e3 * (time.perf_counter() - t0))
            self.clock.synchronize()
        # A call that waits for the GPU while queueing gains nothing from a spin.
        self.spin_ms = (0.0 if queue_ms > 0.5 * PROBE_SPIN_MS
                        else max(MIN_SPIN_MS, 3.0 * queue_ms + 0.1))

    def before(self):
        self.clock.spin(self.spin_ms)

    def __call__(self):
        call = self.calls[self._next % len(self.calls)]
        self._next += 1
        start = self.clock.event()
        call()
        end = self.clock.event()
        end.synchronize()
        self.times.append(self.clock.elapsed_ms(start, end))

    def run(self, reps):
        for _ in range(reps):
            self.before()
            self()
        return self

    def summary(self):
        return dict(ms=statistics.median(self.times), min_ms=min(self.times),
                    reps=len(self.times), spin_ms=round(self.spin_ms, 3),
                    first_call_s=round(self.first_call_s, 3))


def graphs_of(calls):
    """Each of ``calls`` captured once on one stream of their own (after an eager call that
    compiles): (stream, graphs, the captured calls' results). The caller keeps the results
    while it replays the graphs: the replays write there, and memory freed to the pool could
    hold another array meanwhile. Time the replays inside ``with stream:``; replaying them in
    turn, as ``time_calls`` does with several calls, keeps each input set out of L2 where the
    sets together are larger than it."""
    cp.cuda.Device().synchronize()   # the inputs, made on other streams, are there
    stream = cp.cuda.Stream(non_blocking=True)
    graphs, results = [], []
    with stream:
        for call in calls:
            call()
            stream.synchronize()
            stream.begin_capture()
            results.append(call())
            graphs.append(stream.end_capture())
    return stream, graphs, results


def graph_of(call):
    """``graphs_of`` of one call: (stream, graph, result)."""
    stream, (graph,), (result,) = graphs_of([call])
    return stream, graph, result


def time_calls(clock, calls, reps, warmup=3):
    """``Timing.summary()`` of ``calls`` after ``warmup`` calls and ``reps`` timed ones."""
    timing = Timing(clock, calls)
    timing.warm_up(warmup)
    return timing.run(reps).summary()
