"""The command line's answers to bad options (argparse usage errors naming the option, never
a traceback), its help text, and the reason it gives where no GPU is usable."""
import subprocess
import sys
import types

import pytest

import cupyflash.__main__ as cli
from cupyflash import _gpu


def usage_error(capsys, argv):
    """Run the CLI on ``argv``, expect argparse's usage error, return its message."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("shape", ["1,100,2,300", "1,8,1,257", "1,8,1", "1,8,1,8,1", "0,8,1,8",
                                   "1,-8,1,8", "a,b,c,d", "1.5,8,1,8"])
def test_demo_rejects_a_bad_shape_as_a_usage_error(capsys, shape):
    message = usage_error(capsys, ["demo", "--shape", shape])
    assert "argument --shape" in message and repr(shape) in message


def test_demo_head_dim_limit_is_the_library_one(capsys):
    message = usage_error(capsys, ["demo", "--shape", "1,100,2,300"])
    assert f"at most {cli.MAX_HEADDIM}" in message


@pytest.mark.parametrize("argv,option", [
    (["demo", "--repeats", "0"], "--repeats"),
    (["demo", "--repeats", "-1"], "--repeats"),
    (["demo", "--repeats=-3"], "--repeats"),
    (["demo", "--repeats", "2.5"], "--repeats"),
    (["demo", "--repeats", "many"], "--repeats"),
    (["bench", "--reps", "0"], "--reps"),
    (["bench", "--reps", "-2"], "--reps"),
    (["bench", "--reps", "1e3"], "--reps"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--warmup", "x"], "--warmup"),
])
def test_counts_must_be_integers_in_range(capsys, argv, option):
    message = usage_error(capsys, argv)
    assert f"argument {option}" in message and repr(argv[-1].split("=")[-1]) in message


@pytest.mark.parametrize("argv,option", [
    (["bench", "--headdim", "96"], "--headdim"),
    (["bench", "--headdim", "x"], "--headdim"),
    (["bench", "--seqlen", "1000"], "--seqlen"),
    (["bench", "--impl", "fa5"], "--impl"),
])
def test_bench_filters_take_the_grid_values_only(capsys, argv, option):
    message = usage_error(capsys, argv)
    assert f"argument {option}" in message


@pytest.mark.parametrize("error,option", [(ValueError, "--shape"), (TypeError, "--dtype"),
                                          (MemoryError, "--shape")])
def test_demo_turns_a_library_rejection_into_a_usage_error(capsys, monkeypatch, error, option):
    def rejecting(*args, **kwargs):
        raise error("q: rejected by the library\nsecond line")

    monkeypatch.setattr(cli, "flash_attention", rejecting)
    message = usage_error(capsys, ["demo", "--cpu", "--shape", "1,8,1,8", "--dtype", "float32"])
    expected_value = "1,8,1,8" if option == "--shape" else "float32"
    assert message.endswith(f"argument {option}: {expected_value}: q: rejected by the library")


def test_a_bad_shape_from_the_shell_prints_one_line_and_exits_2():
    run = subprocess.run([sys.executable, "-m", "cupyflash", "demo", "--shape", "1,100,2,300"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "python -m cupyflash demo: error: argument --shape:")


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["warmup", "--help"],
                                  ["bench", "--help"]])
def test_help_is_plain_text(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m cupyflash")
    assert "`" not in out


# --- why no GPU is usable ---------------------------------------------------------------

class FakeCudaError(Exception):
    def __init__(self, status):
        super().__init__(f"cudaError {status}")
        self.status = status


def fake_runtime(count=0, status=None, driver=13000, built=13020):
    """A stand-in for cupy.cuda.runtime: ``status`` makes getDeviceCount raise."""
    def get_device_count():
        if status is not None:
            raise FakeCudaError(status)
        return count
    return types.SimpleNamespace(CUDARuntimeError=FakeCudaError,
                                 getDeviceCount=get_device_count,
                                 driverGetVersion=lambda: driver,
                                 runtimeGetVersion=lambda: built)


def test_no_reason_when_a_gpu_is_seen():
    assert _gpu.no_gpu_reason(fake_runtime(count=1)) is None


def test_no_driver_is_not_called_an_old_driver():
    # What CUDA says where libcuda is missing: "insufficient driver", driver version 0.
    why = _gpu.no_gpu_reason(fake_runtime(status=_gpu.INSUFFICIENT_DRIVER, driver=0))
    assert why.startswith("no NVIDIA driver found")
    assert "no usable CUDA GPU" in why and "insufficient" not in why


def test_old_driver_names_both_versions():
    why = _gpu.no_gpu_reason(fake_runtime(status=_gpu.INSUFFICIENT_DRIVER, driver=12040,
                                          built=13020))
    assert "CUDA up to 12.4" in why and "CUDA 13.2 runtime" in why
    assert "built for CUDA 12" in why


@pytest.mark.parametrize("runtime", [fake_runtime(status=_gpu.NO_DEVICE), fake_runtime(count=0)],
                         ids=["no-device-error", "zero-devices"])
def test_driver_without_devices(monkeypatch, runtime):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _gpu.no_gpu_reason(runtime) == ("the NVIDIA driver (CUDA 13.0) is installed but "
                                           "finds no GPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _gpu.no_gpu_reason(runtime).endswith("(CUDA_VISIBLE_DEVICES='')")


def test_other_cuda_errors_are_passed_on():
    why = _gpu.no_gpu_reason(fake_runtime(status=999))
    assert why == "CUDA cannot use the GPU (cudaError 999)"


def driver_version():
    cupy = pytest.importorskip("cupy")
    return cupy.cuda.runtime.driverGetVersion()


@pytest.mark.parametrize("command", ["warmup", "bench"])
def test_gpu_commands_without_a_driver_say_so(capsys, command):
    if driver_version() != 0:
        pytest.skip("an NVIDIA driver is installed here")
    assert cli.main([command]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"{command} needs a CUDA GPU: no NVIDIA driver found (libcuda could not "
                   "be loaded), so this machine has no usable CUDA GPU")


def test_demo_without_a_driver_says_so_and_runs_the_numpy_path(capsys):
    if driver_version() != 0:
        pytest.skip("an NVIDIA driver is installed here")
    assert cli.main(["demo", "--shape", "1,16,1,8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no NVIDIA driver found")
    assert "running the NumPy path on the CPU" in out


def test_bench_leaves_flex_out_unless_named(monkeypatch, capsys):
    """The README's peers list: FlexAttention's dense rows only with ``--impl flex`` (the
    measuring faked: no GPU needed)."""
    seen = []
    monkeypatch.setattr(cli, "gpu_or_reason", lambda: (object(), None))
    monkeypatch.setattr(cli._bench, "gpu_name", lambda: "a GPU")
    monkeypatch.setattr(cli._bench, "compare", lambda case, impls, *a, **k: seen.append(tuple(impls)) or [])
    monkeypatch.setattr(cli._bench, "format_report", lambda rows: "")
    assert cli.main(["bench", "--quick"]) == 0
    assert seen and all("flex" not in impls and "cupyflash" in impls for impls in seen)
    seen.clear()
    assert cli.main(["bench", "--quick", "--impl", "flex"]) == 0
    assert seen and set(seen) == {("flex",)}
