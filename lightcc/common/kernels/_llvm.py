"""Bit-level LLVM intrinsics for the numba kernels, and the kernel compiler.

numba widens every integer operation on ``uint32`` to 64 bits, which halves the SIMD lanes of
the casts; the kernels therefore wrap each step in ``np.uint32(...)`` and take their format
parameters as compile-time constants, so LLVM narrows the arithmetic back to 32-bit lanes
(8 per AVX2 register). The intrinsics here reinterpret bits (no conversion instructions) and
convert to and from IEEE half precision with the CPU's own instructions (x86 F16C
``vcvtps2ph`` / ``vcvtph2ps``): they round to nearest even exactly as the integer code does.
"""
from __future__ import annotations

import types as pytypes
from typing import Any, Callable

import numba
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic


def _host_has_f16c() -> bool:
    """Whether the CPU numba compiles for converts float32 <-> float16 in hardware (x86 F16C).

    Elsewhere LLVM would lower the conversion to a runtime library call that numba's JIT does
    not provide, so the integer path is used instead.
    """
    try:
        import llvmlite.binding as ll
    except ImportError:  # pragma: no cover - llvmlite ships with numba
        return False
    if numba.config.CPU_NAME:          # a fixed target (portable cache): trust its feature list
        return "+f16c" in (numba.config.CPU_FEATURES or "")
    try:
        return bool(ll.get_host_cpu_features().get("f16c", False))
    except RuntimeError:  # pragma: no cover - features unknown on this host
        return False


#: fp16 encodes with the CPU's conversion instruction (bit-identical to the integer path).
HW_F16 = _host_has_f16c()


@intrinsic
def f32_bits(typingctx, x):  # pragma: no cover - compiled
    """The bits of a float32 as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):  # pragma: no cover - compiled
    """The float32 whose bits are the uint32 ``u``."""
    if u != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def f16_bits(typingctx, x):  # pragma: no cover - compiled
    """IEEE half bits of a float32 (round to nearest even; overflow gives Inf; NaN payload
    truncated), zero-extended to uint32. Only where :data:`HW_F16`."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.zext(builder.bitcast(half, ir.IntType(16)), ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def f16_value(typingctx, u):  # pragma: no cover - compiled
    """float32 of the IEEE half whose bits are the low 16 of ``u`` (exact, also for
    subnormals, whatever the thread's flush-to-zero mode). Only where :data:`HW_F16`."""
    if u != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(types.uint32), codegen


def compile_kernel(fn: Callable[..., Any], name: str, parallel: bool) -> Callable[..., Any]:
    """``fn`` compiled with ``nogil=True`` (and ``parallel`` threads) under its own cache name.

    numba names a kernel's on-disk cache file after the function's qualified name; kernels made
    by one factory for several formats (their constants captured in closures) would share one
    file and evict each other, recompiling at every start. A copy of the function named
    ``name`` gets a file of its own.
    """
    copy = pytypes.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__,
                                fn.__closure__)
    copy.__qualname__ = name
    copy.__module__ = fn.__module__
    return njit(nogil=True, cache=True, parallel=parallel)(copy)


__all__ = ["HW_F16", "bits_f32", "compile_kernel", "f16_bits", "f16_value", "f32_bits"]
