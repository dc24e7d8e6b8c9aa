"""``auto``'s decision on one communicator: collective probes, rank 0's choice, its broadcast.

Every rank of the communicator calls :func:`decide` at the same bucket and makes the same
collective calls in the same order (see :mod:`.auto` for when). Rank 0's choice is what every
rank applies; the other ranks only contribute their probe times (maximum over the ranks: a
collective is as slow as its slowest member).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from .. import cachefile as cache
from ..exceptions import ConfigError
from . import autochoice as ac
from .base import BucketContext

log = logging.getLogger("lightcc")

PROBE_SIZES = (1 << 14, 1 << 20)   # probe buffer sizes, fp32 elements (64 KB, 4 MB)
REPS = 5                     # timed repetitions per probe (the minimum counts)
CACHE_TOLERANCE = 0.3        # a cached decision is reused when the link is within this

_ACCURACY_CODE = {a: i + 1 for i, a in enumerate(ac.ACCURACIES)}


def _sync(comm: Any) -> None:
    if getattr(comm, "is_device", False):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def _probe(comp: Any, comm: Any, fmts: list[str], like: Any) -> dict[str, tuple[float, float]]:
    """``fmt -> (latency, s per fp32 byte)``: real allreduces of a probe buffer over ``comm``
    in each format at :data:`.auto.PROBE_SIZES` (minimum of REPS, maximum over the ranks)."""
    big = max(PROBE_SIZES)
    src = as_array(comm, np.linspace(-1.0, 1.0, big, dtype=np.float32), np.float32)
    work = src.copy()
    times = np.full((len(fmts), len(PROBE_SIZES)), np.inf)
    ctxs = [BucketContext(("auto.probe",), (0,), (n,)) for n in PROBE_SIZES]
    for _ in range(REPS):        # formats interleaved: a load spike hits them alike
        for i, fmt in enumerate(fmts):
            for j, n in enumerate(PROBE_SIZES):
                buf = work[:n]
                buf[...] = src[:n]
                comm.barrier()
                t0 = time.perf_counter()
                if fmt == "none":
                    comm.allreduce(buf, "sum")
                else:
                    comp._compressor(fmt).allreduce(comm, buf, ctxs[j])
                _sync(comm)
                times[i, j] = min(times[i, j], time.perf_counter() - t0)
    arr = as_array(comm, times.reshape(-1).tolist())
    comm.allreduce(arr, "max")
    times = host(arr).reshape(times.shape)
    sizes = [4.0 * n for n in PROBE_SIZES]
    return {fmt: ac.fit_line(sizes, times[i]) for i, fmt in enumerate(fmts)}


def host(x: Any) -> np.ndarray:
    """A NumPy copy (or view) of a NumPy or CuPy array."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def as_array(comm: Any, values: Any, dtype: Any = np.float64) -> Any:
    """``values`` in the memory ``comm`` reduces (device communicators: the device)."""
    arr = np.asarray(values, dtype=dtype)
    if getattr(comm, "is_device", False):
        import cupy  # a device communicator implies CuPy

        return cupy.asarray(arr)
    return arr


def world_rank() -> int:
    """This process's world rank as lightcc's log records name it (0 when unknown)."""
    for f in log.filters:
        rank = getattr(f, "rank", None)
        if isinstance(rank, int):
            return rank
    return 0


def cache_settings(comp: Any = None) -> tuple[str, bool]:
    """``(path, refresh)``: what the engine gave ``comp`` (the process's configuration,
    ``init(autotune_cache=..., autotune=...)`` included), else LCC_AUTOTUNE_CACHE and
    LCC_AUTOTUNE from the environment."""
    path = getattr(comp, "cache_path", None)
    if path is None:
        path = os.environ.get("LCC_AUTOTUNE_CACHE", "")
    refresh = getattr(comp, "cache_refresh", None)
    if refresh is None:
        refresh = os.environ.get("LCC_AUTOTUNE", "").strip().lower() == "refresh"
    return path.strip() or cache.default_cache_path(), bool(refresh)


def codec_costs(comp: Any, fmts: list[str], nranks: int, n: int = 1 << 20) -> dict[str, float]:
    """Seconds per fp32 byte of each format's local work in the two-phase scheme (encode the
    bucket, decode and add n copies of one chunk, encode the sum, decode the bucket:
    ``(1 + 1/n)`` encodes and 2 decodes), timed alone on this machine (best of 3)."""
    x = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    out = np.empty_like(x)
    costs = {}
    for fmt in fmts:
        codec = getattr(comp._compressor(fmt), "codec", None)
        if codec is None:
            continue
        payload = np.empty(codec.nbytes(n), np.uint8)
        enc = dec = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            codec.encode_into(x, payload)
            t1 = time.perf_counter()
            codec.decode_into(payload, n, out, True)
            t2 = time.perf_counter()
            enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
        costs[fmt] = ((1.0 + 1.0 / nranks) * enc + 2.0 * dec) / (4.0 * n)
    return costs


def _bcast(comm: Any, values: list[float], dtype: Any = np.float64) -> np.ndarray:
    arr = as_array(comm, values, dtype)
    comm.bcast(arr, 0)
    return host(arr)


def _check_agreement(comp: Any, comm: Any, st: Any) -> None:
    """Every rank raises the same error when the ranks disagree on the accuracy."""
    acc = float(_ACCURACY_CODE[comp.accuracy])
    arr = as_array(comm, [acc, -acc, float(len(st.order)), -float(len(st.order))])
    comm.allreduce(arr, "max")
    hi_acc, lo_acc, hi_n, lo_n = (float(v) for v in host(arr))
    if hi_acc != -lo_acc:
        raise ConfigError("compression=auto: the ranks disagree on its accuracy (lossless on "
                          "some, lossy on others); give every rank the same "
                          "Compression.auto(accuracy=...) or LCC_COMPRESSION_ACCURACY")
    if hi_n != -lo_n:
        raise ConfigError(f"compression=auto: the ranks saw different tensors before deciding "
                          f"({int(-lo_n)} to {int(hi_n)} names)")


def _fingerprint(comp: Any, comm: Any, st: Any) -> dict[str, Any]:
    from ..._version import __version__

    return {"kind": "compression-auto", "accuracy": comp.accuracy,
            "comm": str(getattr(comm, "name", "")), "ranks": int(comm.size),
            "tensors": sorted([name, int(st.sizes[name])] for name in st.order),
            "lightcc": __version__}


def decide(comp: Any, comm: Any, st: Any, like: Any) -> dict[str, Any]:
    """The decision on ``comm`` (collective; see module docstring): ``codes`` (per name index),
    ``default`` (names seen later) and a ``record`` for logs and tests."""
    t_start = time.perf_counter()
    _check_agreement(comp, comm, st)
    root = comm.rank == 0
    probe_fmts = [f for f in comp.formats if f != "bf16"]   # bf16 is derived from fp16
    path, refresh = cache_settings(comp)
    fp = _fingerprint(comp, comm, st)
    key = cache.fingerprint_key(fp)
    entry = None
    if root and not refresh:
        try:
            entry = cache.lookup(path, key)
        except Exception:  # noqa: BLE001 - a broken cache file is no reason to fail training
            entry = None
    cached_slope = float(entry["setting"].get("none_s_per_byte", 0.0)) if entry else 0.0
    has = _bcast(comm, [1.0 if entry else 0.0])[0] > 0
    fit = _probe(comp, comm, ["none"] if has else probe_fmts, like)
    reuse = False
    if has:
        slope = fit["none"][1]
        ok = cached_slope > 0 and abs(slope / cached_slope - 1.0) <= CACHE_TOLERANCE
        reuse = bool(_bcast(comm, [1.0 if ok else 0.0])[0] > 0)
        if not reuse:
            fit.update(_probe(comp, comm, [f for f in probe_fmts if f != "none"], like))
    names = st.order
    codes = np.zeros(len(names) + 1, np.int32)
    model = None
    if root:
        if reuse:
            formats = entry["setting"].get("formats", {})
            for i, name in enumerate(names):
                codes[i] = ac.CODES.get(formats.get(name, "none"), 0)
            codes[-1] = ac.CODES.get(entry["setting"].get("default", "none"), 0)
        else:
            codec = codec_costs(comp, [f for f in comp.formats if f != "none"], comm.size) \
                if isinstance(like, np.ndarray) else {}
            model = ac.LinkModel(comm.size, fit, codec)
            for i, name in enumerate(names):
                allowed = ac.allowed_for(st.errors.get(name), comp.accuracy)
                codes[i] = ac.CODES[ac.choose(model, 4.0 * st.sizes[name], allowed)]
            codes[-1] = ac.CODES[ac.choose(model, 4.0 * (1 << 20),
                                           ac.allowed_for(None, comp.accuracy))]
    codes = _bcast(comm, codes.tolist(), np.int32).astype(np.int32)
    formats = {name: ac.FORMATS[int(codes[i])] for i, name in enumerate(names)}
    record = {"comm": fp["comm"], "ranks": fp["ranks"], "accuracy": comp.accuracy,
              "formats": formats, "default": ac.FORMATS[int(codes[-1])], "cached": reuse,
              "step": st.steps, "fit": {f: list(v) for f, v in fit.items()},
              "seconds": time.perf_counter() - t_start}
    if model is None:
        model = ac.LinkModel(comm.size, fit, {})
    record["link_bytes_per_s"] = model.link_bytes_per_s() if "none" in fit else 0.0
    _report(comp, comm, st, model, record, path, key, fp)
    return {"codes": codes[:-1].copy(), "default": int(codes[-1]), "record": record}


def _report(comp: Any, comm: Any, st: Any, model: Any, record: dict, path: str, key: str,
            fp: dict) -> None:
    """One log line and the cache entry (world rank 0), the timeline event (every rank)."""
    tracer = getattr(comm, "tracer", None)
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for name, fmt in record["formats"].items():
        counts[fmt] = counts.get(fmt, 0) + 1
        nbytes[fmt] = nbytes.get(fmt, 0) + 4 * st.sizes[name]
    if tracer is not None and getattr(tracer, "enabled", False):
        tracer.instant("engine", "AUTO_COMPRESSION", time.perf_counter(), comm=record["comm"],
                       accuracy=comp.accuracy, cached=record["cached"],
                       **{fmt: counts[fmt] for fmt in counts})
    if comm.rank != 0 or world_rank() != 0:
        return
    how = "cached decision, link re-measured" if record["cached"] else \
        f"measured in {record['seconds']:.2f} s"
    log.warning("compression %s on %s: %s (%s; LCC_AUTOTUNE=refresh re-measures)", comp.name,
                record["comm"] or "its communicator", ac.describe(model, counts, nbytes), how)
    if record["cached"]:
        return
    try:
        cache.store(path, key, fp, {"formats": record["formats"], "default": record["default"],
                                    "none_s_per_byte": model.fit["none"][1]},
                    record["link_bytes_per_s"], st.steps)
    except OSError as exc:
        log.warning("compression %s: could not write the autotune cache %s (%s)", comp.name,
                    path, exc)
