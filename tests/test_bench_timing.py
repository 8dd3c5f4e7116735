"""The benchmark clock's spin (CPU only, with a stand-in clock): it must outlast the slowest
call's queueing, or the GPU idles inside the timed window."""
import time

from cupyflash.bench.timing import MIN_SPIN_MS, PROBE_SPIN_MS, Timing


class FakeEvent:
    def __init__(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class FakeClock:
    def __init__(self):
        self.spins = []

    def spin(self, ms):
        self.spins.append(ms)

    def synchronize(self):
        pass

    def event(self):
        return FakeEvent()

    def elapsed_ms(self, start, end):
        return 1e3 * (end.t - start.t)


def sleeper(ms):
    return lambda: time.sleep(ms / 1e3)


def test_spin_covers_the_slowest_input_set():
    clock = FakeClock()
    timing = Timing(clock, [sleeper(0.5), sleeper(4.0), sleeper(1.0)])
    timing.warm_up(2)
    assert timing.spin_ms >= 3 * 4.0
    timing.run(3)
    assert clock.spins[-1] == timing.spin_ms and len(timing.times) == 3


def test_fast_calls_get_the_minimum_spin():
    timing = Timing(FakeClock(), [lambda: None])
    timing.warm_up(1)
    assert timing.spin_ms == MIN_SPIN_MS


def test_calls_that_block_get_no_spin():
    timing = Timing(FakeClock(), [sleeper(PROBE_SPIN_MS)])
    timing.warm_up(1)
    assert timing.spin_ms == 0.0
