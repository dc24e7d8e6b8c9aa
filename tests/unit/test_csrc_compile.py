"""The CUDA kernels in csrc/ compile, and their scalar numerics match the CPU codec bit for bit.

No GPU is needed: ``nvcc --ptx`` compiles every ``csrc/*.cu`` for sm_90 (warnings are errors);
when an NVRTC library is found, each file is also compiled exactly as the loader does it at
run time (headers pasted in, same options). The ``__host__ __device__`` helpers of
``csrc/lcc_common.cuh`` (scale exponents, encode, decode) are built into a small host program
and compared with ``lightcc.common.kernels.floatcast`` on edge cases and random inputs.
Skips (with the reason) when nvcc is absent.
"""
from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lightcc.common.kernels import cuda as kcuda
from lightcc.common.kernels import floatcast as fc

CSRC = Path(__file__).resolve().parents[2] / "csrc"
NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc")
                                else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit)")
SOURCES = sorted(CSRC.glob("*.cu"))


def test_sources_exist():
    names = {p.name for p in SOURCES}
    assert {"quantize.cu", "topk.cu", "pack.cu"} <= names, names


@needs_nvcc
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvcc_ptx(src, tmp_path):
    out = tmp_path / (src.stem + ".ptx")
    proc = subprocess.run([NVCC, "--ptx", "-arch=sm_90", "-std=c++17", "--Werror", "all-warnings",
                           f"-I{CSRC}", str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed on {src.name}:\n{proc.stdout}\n{proc.stderr}"
    ptx = out.read_text()
    for line in src.read_text().splitlines():   # every extern "C" kernel made it into the PTX
        if line.startswith('extern "C" __global__ void '):
            name = line.split("void ", 1)[1].split("(", 1)[0]
            assert f".entry {name}(" in ptx, f"{name} missing from {out.name}"


def _find_nvrtc() -> str | None:
    if os.environ.get("LCC_NVRTC_LIB"):
        return os.environ["LCC_NVRTC_LIB"]
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    pats = [f"{r}/{d}/libnvrtc.so*" for r in roots if r for d in ("lib64", "lib")]
    pats += [p + "/nvidia/cu*/lib/libnvrtc.so*" for p in __import__("site").getsitepackages()]
    for pat in pats:
        for hit in sorted(glob.glob(pat)):
            if "builtins" not in hit:
                return hit
    return None


def test_nvrtc_compiles_like_the_loader():
    """Compile each file through NVRTC exactly as cuda.get_module does (no GPU needed)."""
    path = _find_nvrtc()
    incs = kcuda.cuda_include_dirs()
    if path is None or not incs:
        pytest.skip("no libnvrtc or CUDA headers found (pip install nvidia-cuda-nvrtc, "
                    "or set LCC_NVRTC_LIB=/path/to/libnvrtc.so)")
    lib = ctypes.CDLL(path)
    opts = [o.encode() for o in (*kcuda.compile_options(), "-arch=compute_90", "-ftz=true")]
    for src in SOURCES:
        prog = ctypes.c_void_p()
        code = kcuda.expand_includes(src).encode()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), code, src.name.encode(), 0, None,
                                      None) == 0
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        log = buf.value.decode(errors="replace").strip()
        assert rc == 0 and not log, f"NVRTC on {src.name} (rc {rc}):\n{log}"


# ---- host build of the numeric helpers ----------------------------------------------------------
HOST_PROGRAM = r"""
#include "lcc_common.cuh"
#include <cstdio>
#include <cstdlib>
#include <vector>

template <int F>
void run(const char* mode, long n, FILE* in, FILE* out) {
    typedef typename LccFormat<F>::T T;
    if (mode[0] == 'e') {            // encode: n floats, n int32 exponents -> n uint16 codes
        std::vector<float> x(n); std::vector<int> e(n); std::vector<unsigned short> c(n);
        fread(x.data(), 4, n, in); fread(e.data(), 4, n, in);
        for (long i = 0; i < n; ++i) c[i] = (unsigned short)lcc_encode<F>(x[i], e[i]);
        fwrite(c.data(), 2, n, out);
    } else if (mode[0] == 'd') {     // decode: n uint16 codes, n float scales -> n floats
        std::vector<unsigned short> c(n); std::vector<float> s(n), v(n);
        fread(c.data(), 2, n, in); fread(s.data(), 4, n, in);
        for (long i = 0; i < n; ++i) v[i] = lcc_decode<F>((T)c[i], s[i]);
        fwrite(v.data(), 4, n, out);
    } else {                         // scale: n amax floats -> n int32 exponents
        std::vector<float> a(n); std::vector<int> e(n);
        fread(a.data(), 4, n, in);
        for (long i = 0; i < n; ++i) e[i] = lcc_scale_exponent(a[i], LccFormat<F>::max());
        fwrite(e.data(), 4, n, out);
    }
}

int main(int argc, char** argv) {
    const int fmt = atoi(argv[1]);
    const long n = atol(argv[3]);
    FILE* in = fopen(argv[4], "rb");
    FILE* out = fopen(argv[5], "wb");
    if (fmt == 0) run<LCC_FMT_FP16>(argv[2], n, in, out);
    if (fmt == 1) run<LCC_FMT_BF16>(argv[2], n, in, out);
    if (fmt == 2) run<LCC_FMT_E4M3>(argv[2], n, in, out);
    if (fmt == 3) run<LCC_FMT_E5M2>(argv[2], n, in, out);
    fclose(in); fclose(out);
    return 0;
}
"""
FORMATS = {"fp16": (0, fc.FP16), "bf16": (1, fc.BF16), "e4m3": (2, fc.E4M3), "e5m2": (3, fc.E5M2)}


@pytest.fixture(scope="module")
def host_exe(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found (install the CUDA toolkit)")
    d = tmp_path_factory.mktemp("hostcheck")
    src = d / "hostcheck.cu"
    src.write_text(HOST_PROGRAM)
    exe = d / "hostcheck"
    proc = subprocess.run([NVCC, "-std=c++17", "-O1", f"-I{CSRC}", str(src), "-o", str(exe)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return exe


def _run(exe, fmt_id, mode, n, payload: bytes, out_dtype, tmp_path) -> np.ndarray:
    fin, fout = tmp_path / "in.bin", tmp_path / "out.bin"
    fin.write_bytes(payload)
    subprocess.run([str(exe), str(fmt_id), mode, str(n), str(fin), str(fout)], check=True,
                   timeout=120)
    return np.fromfile(fout, dtype=out_dtype)


def _inputs(rng) -> np.ndarray:
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, 448.0, 464.0,
                        465.0, 480.0, 57344.0, 61440.0, 65504.0, 65520.0, 65519.99, 1e-45,
                        -1e-45, 1.17549435e-38, 1.1754942e-38, 3.4028235e38, -3.4028235e38,
                        2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10, 2.0 ** -24, 2.0 ** -25,
                        3 * 2.0 ** -26, 2.0 ** -133, 2.0 ** -134, 3 * 2.0 ** -135],
                       dtype=np.float32)
    bits = rng.integers(0, 2 ** 32, 60000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    normal = (rng.standard_normal(60000) * np.exp2(rng.integers(-30, 30, 60000))).astype(np.float32)
    # values exactly halfway between neighbouring fp8/fp16 codes (ties to even)
    ties = (np.arange(1, 2000, dtype=np.float32) * 2.0 ** -4 + 2.0 ** -5).astype(np.float32)
    return np.concatenate([special, bits, normal, ties, -ties])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_host_encode_matches_floatcast(host_exe, fmt, tmp_path):
    fmt_id, f = FORMATS[fmt]
    rng = np.random.default_rng(7 + fmt_id)
    x = _inputs(rng)
    exps = np.where(rng.random(x.size) < 0.5, 0, rng.integers(-126, 127, x.size)).astype(np.int32)
    # The contract covers scales made from the block's own amax, where x * 2**-e never
    # overflows float32; drop random (x, e) pairs outside it (both sides saturate, but the
    # CPU codec may take a different route there).
    with np.errstate(over="ignore", invalid="ignore"):
        keep = (exps == 0) | (np.abs(x.astype(np.float64) * np.exp2(-exps.astype(np.float64)))
                              <= np.finfo(np.float32).max)
    x, exps = x[keep], exps[keep]
    # float32 subnormals scaled up by 2**126..2**100 take the exact integer path; include
    # values exactly halfway between two codes of every format (ties to even) and neighbours.
    k = np.concatenate([(2 * np.arange(200) + 1) << sh for sh in (7, 9, 12, 13, 14, 15, 16, 20)])
    k = np.concatenate([k, k + 1, k - 1, rng.integers(1, 1 << 23, 4000)])
    k = k[(k > 0) & (k < 1 << 23)].astype(np.uint32)
    sub = np.concatenate([k.view(np.float32), -k.view(np.float32)])
    sub_e = rng.choice(np.array([-126, -125, -120, -110, -100, 0], np.int32), sub.size)
    x, exps = np.concatenate([x, sub]), np.concatenate([exps, sub_e])
    want = fc.encode(x, f, exps.astype(np.int64), 1).astype(np.uint16)
    got = _run(host_exe, fmt_id, "e", x.size, x.tobytes() + exps.tobytes(), np.uint16, tmp_path)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{fmt}: {bad.size} codes differ, e.g. x={x[bad[:5]]!r} "
                           f"e={exps[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_host_decode_matches_floatcast(host_exe, fmt, tmp_path):
    fmt_id, f = FORMATS[fmt]
    rng = np.random.default_rng(11 + fmt_id)
    codes = np.arange(1 << f.nbits, dtype=np.int64)
    codes = np.concatenate([codes, rng.integers(0, 1 << f.nbits, 30000)]).astype(f.code_dtype)
    exps = rng.integers(-126, 127, codes.size)
    scales = fc.exps_to_scales(exps)
    want = fc.decode(codes, f, scales, 1)
    got = _run(host_exe, fmt_id, "d", codes.size,
               codes.astype(np.uint16).tobytes() + scales.tobytes(), np.float32, tmp_path)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (f"{fmt}: {bad.size} values differ, e.g. code={codes[bad[:5]]} "
                           f"scale={scales[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_host_scale_exponents_match_floatcast(host_exe, fmt, tmp_path):
    fmt_id, f = FORMATS[fmt]
    rng = np.random.default_rng(3)
    amax = np.abs(np.concatenate([
        np.array([0.0, 1e-45, 1.17549435e-38, f.max, np.nextafter(f.max, np.float32(np.inf)),
                  3.4028235e38, 1.0, 0.5], np.float32),
        rng.integers(1, 0x7F800000, 20000, dtype=np.uint32).view(np.float32),
        np.minimum(f.max * np.exp2(rng.integers(-40, 40, 5000)), 3.4e38).astype(np.float32),
    ])).astype(np.float32)
    want = fc.scale_exponents(amax, f.max).astype(np.int32)
    got = _run(host_exe, fmt_id, "s", amax.size, amax.tobytes(), np.int32, tmp_path)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{fmt}: amax={amax[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}"
