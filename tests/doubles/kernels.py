"""NumPy emulation of lightcc's CUDA kernels, and the launch checks of the GPU doubles.

:func:`emulate` runs a kernel of ``csrc/`` on NumPy per its documented contract, so the Python
orchestration around the kernels (``compression/gpu.py``) can be tested without a GPU.
:func:`ptx_params` compiles ``csrc/*.cu`` to PTX with nvcc (when installed) and returns each
kernel's parameter types, against which :func:`check_launch` checks every launch: argument
count, sizes and float32-ness, so a swapped, missing or mistyped argument fails.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_THREADS = 256                     # lightcc.common.kernels.cuda.THREADS
SIZES = {".u64": 8, ".b64": 8, ".s64": 8, ".u32": 4, ".s32": 4, ".b32": 4, ".f32": 4}


@functools.lru_cache(maxsize=1)
def ptx_params() -> dict[str, dict[str, list[str]]] | None:
    """``{file: {kernel: [param types]}}`` from nvcc's PTX, or None without nvcc."""
    nvcc = shutil.which("nvcc") or "/usr/local/bin/nvcc"
    if not Path(nvcc).exists():
        return None
    out: dict[str, dict[str, list[str]]] = {}
    with tempfile.TemporaryDirectory() as d:
        for src in sorted(CSRC.glob("*.cu")):
            ptx = Path(d) / (src.stem + ".ptx")
            subprocess.run([nvcc, "--ptx", "-arch=sm_90", "-std=c++17", f"-I{CSRC}", str(src),
                            "-o", str(ptx)], check=True, capture_output=True, timeout=300)
            entries = re.findall(r"\.entry (\w+)\(\s*(.*?)\)", ptx.read_text(), re.S)
            out[src.name] = {name: re.findall(r"\.param (\.\w+) ", body)
                             for name, body in entries}
    return out


def check_launch(params: dict | None, module: str, func: str, grid: Any, block: Any,
                 args: tuple, is_array: Callable[[Any], bool], threads: int) -> None:
    """Assert that a launch of ``module:func`` matches the kernel's PTX signature."""
    assert isinstance(grid, tuple) and isinstance(block, tuple), "grid and block are tuples"
    assert grid[0] >= 1 and block == (threads,), (grid, block)
    if params is None:
        return
    assert module in params, module
    assert func in params[module], f"{func} not in {module}"
    types_ = params[module][func]
    assert len(args) == len(types_), f"{func}: {len(args)} args, {len(types_)} params"
    for i, (a, t) in enumerate(zip(args, types_)):
        assert is_array(a) or isinstance(a, np.generic), f"{func} arg {i}: {type(a)}"
        size = 8 if is_array(a) else a.itemsize
        assert size == SIZES[t], f"{func} arg {i}: {size} bytes for {t}"
        if t == ".f32":
            assert isinstance(a, np.float32), f"{func} arg {i} must be float32"


def _key_u(keys: np.ndarray) -> np.ndarray:
    """|x| bits of TopK candidate keys (csrc/topk.cu: key = ~bits << 32 | index)."""
    return (~(keys >> np.uint64(32))).astype(np.uint32)


def emulate(func: str, args: tuple, to_np: Callable[[Any], Any],
            deref: Callable[[int, Any, int], np.ndarray]) -> None:
    """Run kernel ``func`` on NumPy per its contract in csrc/.

    ``to_np`` turns a device-array argument into its NumPy memory (None for anything else);
    ``deref(ptr, dtype, n)`` gives the NumPy view of ``n`` elements at a device pointer (the
    pointer tables of pack/unpack).
    """
    from lightcc.common.kernels import floatcast as fc

    a = [to_np(v) if to_np(v) is not None else
         (None if isinstance(v, np.uint64) and func not in ("lcc_topk_sample", "lcc_topk_threshold") and v == 0 else v)
         for v in args]                                  # np.uint64(0) is a null pointer
    fmt = fc.FORMATS.get(func.rsplit("_", 1)[-1])
    if func in ("lcc_amax_warp", "lcc_amax_big"):
        x, n, bs, _, amax = a
        np.maximum(amax, fc.block_amax(x[:n], int(bs)), out=amax)
    elif func == "lcc_scale_exponents":
        amax, nb, fmax, exps, scales = a
        e = fc.scale_exponents(amax[:nb], float(fmax))
        if exps is not None:
            exps[:] = e
        if scales is not None:
            scales[:] = fc.exps_to_scales(e)
    elif func.startswith("lcc_quantize_"):
        x, n, bs, exps, q = a
        q[:n] = fc.encode(x[:n], fmt, None if exps is None else exps.astype(np.int64), int(bs))
    elif func.startswith("lcc_dequant_sum_"):
        q, scales, n, nsrc, qs, ss, bs, phase, acc, out = a
        assert phase == 0
        if not acc:
            out[:n] = 0
        for r in range(nsrc):
            sc = None if scales is None else scales[r * ss:(r + 1) * ss]
            fc.decode(q[r * qs:r * qs + n], fmt, sc, int(bs), out=out[:n], accumulate=True)
    elif func.startswith("lcc_decode_payload_"):
        payload, n, nsrc, src_bytes, ns, bs, acc, out = a
        if not acc:
            out[:n] = 0
        for r in range(nsrc):
            p = payload[r * src_bytes:(r + 1) * src_bytes]
            sc = np.frombuffer(p[:4 * ns].tobytes(), np.float32) if ns else None
            codes = p[4 * ns:4 * ns + n * fmt.itemsize].view(fmt.code_dtype)
            fc.decode(codes, fmt, sc, int(bs), out=out[:n], accumulate=True)
    elif func == "lcc_topk_sample":
        x, n, ns, seed, out = a
        out[:] = np.abs(x[np.random.default_rng(int(seed)).integers(0, n, ns)])
        out[np.isnan(out)] = np.inf
    elif func == "lcc_topk_hist":
        keys, m, state, shift, bits, first, hist = a
        u = _key_u(keys[:m])
        if not first:
            u = u[(u & np.uint32(state[1])) == np.uint32(state[0])]
        np.add.at(hist, (u >> np.uint32(shift)) & np.uint32((1 << bits) - 1), 1)
    elif func == "lcc_topk_pick":
        hist, state, shift, bits, k_init = a
        if k_init > 0:
            state[:] = [0, 0, k_init, 0]
        before = 0
        for b in range((1 << bits) - 1, -1, -1):
            h = int(hist[b])
            if before < int(state[2]) <= before + h:
                state[0] |= np.uint64(b << shift)
                state[1] |= np.uint64(((1 << bits) - 1) << shift)
                state[2] -= np.uint64(before)
                state[3] += np.uint64(before)
                break
            before += h
        hist[:] = 0
    elif func == "lcc_topk_mark":
        keys, m, state, gt, tie = a
        u, idx = _key_u(keys[:m]), (keys[:m] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        v = np.uint32(state[0])
        for mask, sel in ((gt, u > v), (tie, u == v)):
            np.bitwise_or.at(mask, idx[sel] >> 5, np.left_shift(np.uint32(1),
                                                               (idx[sel] & 31).astype(np.uint32)))
    elif func == "lcc_topk_block_counts":
        gt, tie, nw, counts = a
        for j, mask in enumerate((gt, tie)):
            pop = np.bitwise_count(mask[:nw]).astype(np.int64)
            pop = np.concatenate([pop, np.zeros(-nw % _THREADS, np.int64)])
            counts[j::2] = pop.reshape(-1, _THREADS).sum(axis=1)
    elif func == "lcc_topk_scan_blocks":
        counts, nb = a
        for j in range(2):
            c = counts[j:2 * nb:2].copy()
            counts[j:2 * nb:2] = np.cumsum(c) - c
    elif func == "lcc_topk_emit":
        gt, tie, nw, excl, state, out = a
        ones = [np.flatnonzero(np.unpackbits(m[:nw].view(np.uint8), bitorder="little"))
                for m in (gt, tie)]
        out[:] = np.sort(np.concatenate([ones[0], ones[1][:int(state[2])]]))
    elif func == "lcc_topk_threshold":
        x, n, seed, rank, thr = a
        sample = np.abs(x[np.random.default_rng(int(seed)).integers(0, n, 8192)])
        sample[np.isnan(sample)] = np.inf
        thr[0] = np.sort(sample)[::-1][int(rank) - 1] if rank <= 8192 else 0.0
    elif func == "lcc_topk_select":
        x, n, thr, thr_dev, cap, count, keys = a
        if thr_dev is not None:
            thr = thr_dev[0]
        with np.errstate(invalid="ignore"):
            cand = np.flatnonzero(~(np.abs(x[:n]) < thr))
        bits = np.abs(x[cand]).view(np.uint32).astype(np.uint64)
        bits = np.minimum(bits, np.uint64(0x7F800000))
        k = ((np.uint64(0xFFFFFFFF) - bits) << np.uint64(32)) | cand.astype(np.uint64)
        np.random.default_rng(0).shuffle(k)              # atomics give no order
        count[0] = cand.size
        keys[:min(cand.size, cap)] = k[:cap]
    elif func.startswith("lcc_scatter_add_"):
        dst, n, idx, val, m, bad = a
        ok = (idx[:m] >= 0) & (idx[:m] < n)
        bad[0] += int((~ok).sum())
        np.add.at(dst, idx[:m][ok], val[:m][ok])
    elif func.startswith(("lcc_pack_", "lcc_unpack_")):
        ptrs, offsets, starts, nt, chunk, bucket, scale = a
        for t in range(nt):
            seg = slice(int(offsets[t]), int(offsets[t + 1]))
            view = deref(int(ptrs[t]), bucket.dtype, seg.stop - seg.start)
            scaled = "scale" in func
            if func.startswith("lcc_pack_"):
                bucket[seg] = view * scale if scaled else view
            else:
                view[:] = bucket[seg] * scale if scaled else bucket[seg]
    else:
        raise AssertionError(f"no emulation for {func}")
