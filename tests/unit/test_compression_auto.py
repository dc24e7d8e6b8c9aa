"""compression=auto: the decision function against hand-computed predictions, and the
compressor's whole cycle (measure, decide, broadcast, run, re-check, cache) on thread ranks
with the probe replaced by fixed link measurements, results against NumPy simulations."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from lightcc.common import config
from lightcc.common.compression import BucketContext, autochoice as ac, autoprobe, make
from lightcc.common.compression.api import Compression
from lightcc.common.exceptions import ConfigError
from tests.doubles.fake_nccl import thread_worlds

MB4 = 4.0 * (1 << 20)

# a 1 Gbit link between 2 ranks: 125 MB/s; uncompressed ring sends 2(n-1)/n = 1 byte per
# byte of buffer -> 8 ns per fp32 byte; fp16 halves the bytes (4 ns) and adds its codec
SLOW = ac.LinkModel(2, {"none": (2e-4, 8e-9), "fp16": (5e-4, 4.3e-9),
                        "fp8:e4m3:bucket": (5e-4, 2.4e-9)},
                    {"fp16": 0.3e-9, "bf16": 0.5e-9})
# one machine: shared memory at ~3 GB/s of buffer; the codec costs more than the halved copy
SHM = ac.LinkModel(2, {"none": (2e-5, 0.33e-9), "fp16": (6e-5, 0.55e-9)},
                   {"fp16": 0.3e-9, "bf16": 0.5e-9})


def test_predictions_are_the_fitted_lines():
    # hand: 2e-4 + 8e-9 * 4 MiB = 0.0337544 s; fp16 5e-4 + 4.3e-9 * 4 MiB = 0.0185355 s
    assert ac.predict(SLOW, "none", MB4) == pytest.approx(0.0337544, rel=1e-5)
    assert ac.predict(SLOW, "fp16", MB4) == pytest.approx(0.0185355, rel=1e-5)
    assert ac.predict(SLOW, "fp16", MB4, latency=False) == pytest.approx(0.0180355, rel=1e-5)
    # bf16 is derived: fp16's wire plus the codec difference 0.2 ns/B -> 4.5 ns/B
    assert ac.with_derived(SLOW).fit["bf16"] == pytest.approx((5e-4, 4.5e-9))
    assert SLOW.link_bytes_per_s() == pytest.approx(125e6)
    assert ac.fit_line([1.0, 3.0], [5.0, 9.0]) == (3.0, 2.0)
    assert ac.fit_line([1.0, 3.0], [5.0, 4.0]) == (5.0, 0.0)    # never a negative slope


def test_slow_link_chooses_fp16_one_machine_chooses_none():
    lossless = ac.allowed_for(None, "lossless")
    assert lossless == ("none", "fp16")
    assert ac.choose(SLOW, MB4, lossless) == "fp16"
    assert ac.choose(SHM, MB4, lossless) == "none"
    # the lossy tier only when allowed: fp8 (2.4 ns/B) beats fp16 (4.3) on the slow link
    assert ac.choose(SLOW, MB4, ac.allowed_for(None, "lossy")) == "fp8:e4m3:bucket"
    assert "fp8:e4m3:bucket" not in lossless


def test_a_format_must_win_by_the_margin():
    close = ac.LinkModel(2, {"none": (0.0, 1e-9), "fp16": (0.0, 0.97e-9)})
    assert ac.choose(close, MB4, ("none", "fp16")) == "none"     # 3 % < MARGIN (5 %)
    clear = ac.LinkModel(2, {"none": (0.0, 1e-9), "fp16": (0.0, 0.90e-9)})
    assert ac.choose(clear, MB4, ("none", "fp16")) == "fp16"


def test_bf16_only_where_fp16s_range_loses():
    rng = np.random.default_rng(0)
    typical = rng.standard_normal(4096).astype(np.float32) * 1e-2
    huge = typical * 1e7                     # beyond fp16's 65504: fp16 saturates
    tiny = typical * 1e-4                    # ~1e-6: fp16 subnormals keep a few bits only
    for sample, want in ((typical, "fp16"), (huge, "bf16"), (tiny, "bf16")):
        errors = ac.range_errors(sample, 2)
        allowed = ac.allowed_for(errors, "lossless")
        assert want in allowed and ({"fp16", "bf16"} - {want}).isdisjoint(allowed), \
            (want, errors)
    # hand: 1e5 saturates to 65504 in fp16 (error 34496), bf16 rounds it to 99840 (160)
    e16, ebf = ac.range_errors(np.array([1e5], np.float32), 1)
    assert e16 == pytest.approx(2 * 34496.0 ** 2) and ebf == pytest.approx(2 * 160.0 ** 2)


def test_accuracy_knobs_and_errors(monkeypatch):
    assert Compression.auto.spec == "auto"
    assert Compression.auto(accuracy="lossy").spec == "auto:lossy"
    assert Compression.auto("lossless").spec == "auto:lossless"
    with pytest.raises(ConfigError, match="accuracy"):
        Compression.auto(accuracy="fast")
    with pytest.raises(ValueError, match="accuracy"):
        make("auto:fast")
    assert make("auto").formats == ("none", "fp16", "bf16")
    assert make("auto:lossy").formats == ("none", "fp16", "bf16", "fp8:e4m3:bucket")
    with pytest.raises(ConfigError, match="LCC_COMPRESSION_ACCURACY"):
        config.load(environ={"LCC_COMPRESSION_ACCURACY": "fast"})
    with pytest.raises(ConfigError, match="LCC_COMPRESSION"):
        config.load(environ={"LCC_COMPRESSION": "auto:fast"})
    assert config.load(environ={"LCC_COMPRESSION": "auto"}).compression_accuracy == "lossless"
    pytest.importorskip("torch")
    import lightcc.torch as lcc

    assert lcc.Compression.auto.spec == "auto"
    assert lcc.Compression.auto(accuracy="lossy").spec == "auto:lossy"


# ---- the compressor on thread ranks ---------------------------------------------------------
SIZES = (5000, 3000, 20000)       # elements: three tensors of one bucket
NAMES = ("w1", "w2", "w3")
CTX = BucketContext(NAMES, (0, 5000, 8000), SIZES)


def _fixed_probe(fits):
    def probe(comp, comm, fmts, like):
        return {f: fits[f] for f in fmts}
    return probe


@pytest.fixture
def auto_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LCC_AUTOTUNE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.delenv("LCC_AUTOTUNE", raising=False)
    monkeypatch.setattr(autoprobe, "codec_costs", lambda *a, **k: {})
    return tmp_path / "cache.json"


def _run_steps(p, specs, steps, data_fn, monkeypatch=None):
    """``steps`` buckets on ``p`` thread ranks; returns (compressors, per-step outputs)."""
    from tests.doubles.fake_nccl import run_ranks

    worlds = thread_worlds(p)
    comps = [make(specs[r]) for r in range(p)]
    outs = []
    for step in range(steps):
        data = [data_fn(step, r) for r in range(p)]
        bufs = [d.copy() for d in data]
        errors = [None] * p

        def body(r):
            try:
                comps[r].allreduce(worlds[r], bufs[r], CTX)
            except Exception as exc:  # noqa: BLE001 - every rank's error is checked
                errors[r] = exc
        run_ranks(p, body)
        outs.append((data, bufs, errors))
        if any(errors):
            break
    return comps, worlds, outs


def _half_sum(data, fmt_dtype):
    """The two-phase scheme, simulated: each rank's values rounded to the format, summed in
    fp32 in rank order, the sum rounded again."""
    acc = np.zeros_like(data[0])
    for d in data:
        acc += d.astype(fmt_dtype).astype(np.float32)
    return acc.astype(fmt_dtype).astype(np.float32)


def _exact_sum(data):
    acc = data[0].copy()
    for d in data[1:]:
        acc += d
    return acc


def _data(scale_w3=1.0):
    def fn(step, r):
        x = np.random.default_rng(100 * step + r).standard_normal(sum(SIZES)).astype(np.float32)
        x[8000:] *= np.float32(scale_w3)
        return x
    return fn


def test_slow_link_every_rank_switches_to_fp16_and_sums_like_the_simulation(monkeypatch,
                                                                           auto_env):
    monkeypatch.setattr(autoprobe, "_probe", _fixed_probe(SLOW.fit))
    comps, worlds, outs = _run_steps(3, ["auto"] * 3, 4, _data())
    for step, (data, bufs, errors) in enumerate(outs):
        assert errors == [None] * 3
        want = _exact_sum(data) if step < 2 else _half_sum(data, np.float16)
        for b in bufs:      # measuring: exact; decided: fp16's two-phase bit for bit
            np.testing.assert_array_equal(b, want)
    choices = [c.choice(w) for c, w in zip(comps, worlds)]
    assert choices[0] == {"w1": "fp16", "w2": "fp16", "w3": "fp16"}
    assert choices.count(choices[0]) == 3
    assert all(c.needs_agreement(w) for c, w in zip(comps, worlds))
    assert [len(c.decisions) for c in comps] == [1, 1, 1]
    entry = json.loads(auto_env.read_text())["entries"]
    assert [e["setting"]["formats"] for e in entry.values()] == [choices[0]]


def test_one_machine_stays_uncompressed_and_exact(monkeypatch, auto_env):
    monkeypatch.setattr(autoprobe, "_probe", _fixed_probe(SHM.fit))
    comps, worlds, outs = _run_steps(2, ["auto"] * 2, 4, _data())
    for data, bufs, errors in outs:
        for b in bufs:
            np.testing.assert_array_equal(b, _exact_sum(data))
    assert comps[1].choice(worlds[1]) == {"w1": "none", "w2": "none", "w3": "none"}
    assert not any(c.needs_agreement(w) for c, w in zip(comps, worlds))


def test_a_tensor_beyond_fp16s_range_gets_bf16_the_others_fp16(monkeypatch, auto_env):
    monkeypatch.setattr(autoprobe, "_probe", _fixed_probe(SLOW.fit))
    comps, worlds, outs = _run_steps(2, ["auto"] * 2, 3, _data(scale_w3=1e6))
    assert comps[1].choice(worlds[1]) == {"w1": "fp16", "w2": "fp16", "w3": "bf16"}
    data, bufs, _ = outs[-1]
    want = np.concatenate([_half_sum([d[:8000] for d in data], np.float16),
                           _half_sum([d[8000:] for d in data], ml_dtypes.bfloat16)])
    for b in bufs:
        np.testing.assert_array_equal(b, want)


def test_ranks_that_disagree_on_the_accuracy_all_fail(monkeypatch, auto_env):
    monkeypatch.setattr(autoprobe, "_probe", _fixed_probe(SLOW.fit))
    _, _, outs = _run_steps(3, ["auto", "auto", "auto:lossy"], 4, _data())
    errors = outs[-1][2]
    assert all(isinstance(e, ConfigError) and "disagree" in str(e) for e in errors), errors


def test_the_cache_is_reused_when_the_link_matches_and_refresh_ignores_it(monkeypatch,
                                                                          auto_env):
    monkeypatch.setattr(autoprobe, "_probe", _fixed_probe(SLOW.fit))
    _run_steps(2, ["auto"] * 2, 3, _data())
    comps, _, _ = _run_steps(2, ["auto"] * 2, 3, _data())
    assert [c.decisions[0]["cached"] for c in comps] == [True, True]
    assert comps[0].decisions[0]["formats"]["w1"] == "fp16"
    # the link changed (one machine now): the cached choice is not reused
    monkeypatch.setattr(autoprobe, "_probe", _fixed_probe(SHM.fit))
    comps, _, _ = _run_steps(2, ["auto"] * 2, 3, _data())
    assert [c.decisions[0]["cached"] for c in comps] == [False, False]
    assert comps[0].decisions[0]["formats"]["w1"] == "none"
    monkeypatch.setenv("LCC_AUTOTUNE", "refresh")
    comps, _, _ = _run_steps(2, ["auto"] * 2, 3, _data())
    assert [c.decisions[0]["cached"] for c in comps] == [False, False]


def test_a_drifting_step_time_makes_every_rank_decide_again(monkeypatch, auto_env):
    import time
    import types

    from lightcc.common.compression import auto

    monkeypatch.setattr(autoprobe, "_probe", _fixed_probe(SLOW.fit))
    monkeypatch.setattr(auto, "CHECK_EVERY", 3)
    # a clock that steps 30 s ahead before every step from step 9 on: the steps become much
    # slower (drift) without the test sleeping for it (it slept 0.5 s a step, 7.5 s in all), and
    # far beyond any delay of a loaded machine (a first numba compile) in the baseline window
    ahead = [0.0]
    monkeypatch.setattr(auto, "time", types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + ahead[0]))

    def data(step, r):
        if r == 1 and step >= 9:
            ahead[0] += 30.0
        return _data()(step, r)
    comps, _, outs = _run_steps(2, ["auto"] * 2, 24, data)
    assert all(e is None for _, _, errs in outs for e in errs)
    counts = [len(c.decisions) for c in comps]
    assert counts[0] == counts[1] >= 2, counts
