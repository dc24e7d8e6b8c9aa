"""Device-time mode of benchmarks/training.py: the clock's accounting (with a fake clock, so no
timing is asserted), the profile files, and the converted model's parameters and gradients."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import devicetime  # noqa: E402
import models  # noqa: E402
import realmodels  # noqa: E402


class FakeTime:
    """A clock that advances only when asked: every read costs ``tick`` s (the spin loop's
    reads), every sleep lasts what it was asked plus ``overshoot`` s."""

    def __init__(self, tick=1e-4, overshoot=3e-4):
        self.t, self.tick, self.overshoot, self.sleeps = 0.0, tick, overshoot, []

    def now(self):
        self.t += self.tick
        return self.t

    def sleep(self, s):
        self.sleeps.append(s)
        self.t += s + self.overshoot


def test_busy_share_and_overshoot_carried_to_the_next_sleep():
    ft = FakeTime()
    clock = devicetime.DeviceClock(cpu_share=0.1, now=ft.now, sleep=ft.sleep)
    for _ in range(50):
        clock.spend(0.010)
    assert clock.asked == pytest.approx(0.5)
    # without carrying, 50 overshoots of 0.3 ms would add 15 ms; with it, at most one remains
    assert abs(clock.spent - clock.asked) <= ft.overshoot + 2 * ft.tick
    assert clock.busy == pytest.approx(0.05, abs=50 * 2 * ft.tick)
    assert ft.sleeps[0] == pytest.approx(0.009, abs=3 * ft.tick)
    assert ft.sleeps[1] < ft.sleeps[0] - ft.overshoot / 2      # the first overshoot repaid


def test_a_debt_longer_than_a_layer_skips_its_sleep():
    ft = FakeTime(tick=1e-5, overshoot=5e-3)
    clock = devicetime.DeviceClock(cpu_share=0.0, now=ft.now, sleep=ft.sleep)
    clock.spend(0.001)                  # overshoots by 5 ms
    n = len(ft.sleeps)
    clock.spend(0.001)                  # owes more than it asks: no sleep
    assert len(ft.sleeps) == n
    assert clock.debt == pytest.approx(0.004, abs=1e-4)


@pytest.mark.parametrize("name", ["resnet50", "bert", "gpt2"])
def test_profile_files_parse_and_time_every_parameter_owner_once(name):
    prof = devicetime.load_profile(name)
    assert "A100" in prof["source"] and prof["batch"] > 0
    with torch.device("meta"):
        model = realmodels.REAL_MODELS[name]()
    layers = devicetime.plan(model, prof, prof["batch"])
    assert sum(l.fwd_s for l in layers) * 1e3 == pytest.approx(prof["F_ms"], rel=1e-3)
    assert sum(l.bwd_s for l in layers) * 1e3 == pytest.approx(prof["B_ms"], rel=1e-3)
    half = devicetime.plan(model, prof, prof["batch"] // 2)
    assert sum(l.bwd_s for l in half) == pytest.approx(sum(l.bwd_s for l in layers) / 2)


def test_a_profile_that_misses_a_module_is_refused():
    prof = devicetime.load_profile("resnet50")
    prof["layers"] = [l for l in prof["layers"] if l["name"] != "fc"]
    with torch.device("meta"):
        model = realmodels.REAL_MODELS["resnet50"]()
    with pytest.raises(ValueError, match="fc"):
        devicetime.plan(model, prof, 8)


def test_converted_model_keeps_parameters_and_spends_f_and_b():
    torch.manual_seed(0)
    model = models.build("resmlp")
    ft = FakeTime(tick=1e-6, overshoot=0.0)
    clock = devicetime.DeviceClock(cpu_share=0.1, now=ft.now, sleep=ft.sleep)
    layers = devicetime.plan(model, None, 32, f_ms=40.0, b_ms=80.0)
    dev = devicetime.convert(model, layers, clock)
    want = {n: p for n, p in model.named_parameters()}
    got = dict(dev.named_parameters())
    assert list(got) == list(want) and all(got[n] is want[n] for n in want)
    out = dev(torch.zeros(4, 1, 28, 28))
    assert clock.asked == pytest.approx(0.040)
    devicetime.device_loss(out, None).backward()
    assert clock.asked == pytest.approx(0.120)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    big = max(layers, key=lambda l: l.fwd_s)
    share = sum(p.numel() for p in model.get_submodule(big.name).parameters(False)) / sum(
        p.numel() for p in model.parameters())
    assert big.fwd_s == pytest.approx(0.040 * share)


def test_free_layer_runs_without_parameters_in_its_place():
    with torch.device("meta"):
        model = realmodels.REAL_MODELS["gpt2"]()
    prof = devicetime.load_profile("gpt2")
    layers = devicetime.plan(model, prof, prof["batch"])
    assert layers[-1].name == "lm_head" and layers[-1].free
    assert sum(1 for l in layers if l.name == "wte") == 1
