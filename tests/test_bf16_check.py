"""bf16 on a CPU without native bf16 is refused before training (with an override); the detection
reads /proc/cpuinfo flags and times a probe matmul (both injected here)."""

import pytest

from llmstack.errors import UserError
from llmstack.training import cpu_bf16, precision
from llmstack.training.config import TrainConfig
from llmstack.training.cpu_bf16 import CpuBf16Report, bf16_speed_ratio, cpu_bf16_flags
from llmstack.training.precision import check_precision_supported

BF16 = {"bf16": {"enabled": True}}
EMULATED = CpuBf16Report("AVX2", (), speed_ratio=0.03)  # as the AMD EPYC under KVM measured


class CpuAccelerator:
    """DeepSpeed's CPU accelerator as the check sees it (so the test means the same on a GPU machine)."""

    def device_name(self):
        return "cpu"

    def is_bf16_supported(self):
        return True

    def is_fp16_supported(self):
        return False


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    monkeypatch.setattr(precision, "get_accelerator", CpuAccelerator)


def test_bf16_on_a_cpu_without_native_bf16_is_refused_with_advice_and_an_override():
    with pytest.raises(UserError, match="no native bf16") as refused:
        check_precision_supported(BF16, cpu_report=lambda: EMULATED)
    message = str(refused.value)
    assert "capability AVX2" in message and "0.03x fp32" in message
    assert "fp32 ds_config" in message and "train.allow_emulated_bf16: true" in message
    check_precision_supported(BF16, allow_emulated_bf16=True, cpu_report=lambda: EMULATED)
    assert TrainConfig().allow_emulated_bf16 is False


def test_native_bf16_and_fp32_runs_pass(monkeypatch):
    check_precision_supported(BF16, cpu_report=lambda: CpuBf16Report("AVX512", ("avx512_bf16", "amx_bf16")))
    check_precision_supported(BF16, cpu_report=lambda: CpuBf16Report("DEFAULT", (), speed_ratio=2.0))  # e.g. Arm

    def not_asked():
        raise AssertionError("fp32 needs no bf16 check")

    check_precision_supported({}, cpu_report=not_asked)


def test_native_bf16_flags_are_read_from_cpuinfo():
    assert cpu_bf16_flags("flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n") == (
        "avx512_bf16",
        "amx_bf16",
    )
    assert cpu_bf16_flags("flags\t\t: fpu sse avx2 fma\n") == ()
    assert cpu_bf16_flags("Features\t: fp asimd bf16 i8mm\n") == ("bf16",)


def test_the_probe_compares_bf16_with_fp32_matmul_time():
    # fp32 and bf16 matmuls alternate; they "take" 1 s and 30 s (the clock moves only when read).
    steps = iter([1.0, 1.0, 30.0, 30.0] * 3)
    now = [0.0]

    def clock():
        now[0] += next(steps) / 2
        return now[0]

    assert bf16_speed_ratio(size=8, clock=clock) == pytest.approx(1 / 30)


def test_the_report_probes_only_where_no_flag_says_native(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "cpu_bf16_flags", lambda: ("amx_bf16",))
    monkeypatch.setattr(cpu_bf16, "bf16_speed_ratio", lambda: pytest.fail("probed"))
    assert cpu_bf16.cpu_bf16_report().native
    monkeypatch.setattr(cpu_bf16, "cpu_bf16_flags", lambda: ())
    monkeypatch.setattr(cpu_bf16, "bf16_speed_ratio", lambda: 0.03)
    assert not cpu_bf16.cpu_bf16_report().native
