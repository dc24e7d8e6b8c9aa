"""Integer scaling (prescale/postscale on integer arrays) as Horovod's ScaleBuffer does it:
``(T)(double factor * value)``, i.e. truncation toward zero of the float64 product."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lightcc.common import dtypes
from lightcc.common.exceptions import InvalidArgumentError


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "int64"])
@pytest.mark.parametrize("factor", [0.5, 1.5, 0.37, 2.0 / 3.0, 3.0, -0.25])
def test_scale_integers_truncates_the_float64_product(dtype, factor):
    info = np.iinfo(dtype)
    lo, hi = (0, 40) if info.min == 0 else (-40, 40)
    values = np.arange(lo, hi, dtype=dtype)
    got = dtypes.scale_integers(values.copy(), factor)
    bits = info.bits
    for v, g in zip(values.tolist(), got.tolist()):
        want = math.trunc(factor * float(v)) % (1 << bits)       # C's conversion, then wrap
        if info.min < 0 and want >= 1 << (bits - 1):
            want -= 1 << bits
        assert g == want, (v, factor)


def test_scale_integers_out_of_place_keeps_the_input():
    x = np.array([-7, 7], np.int32)
    out = dtypes.scale_integers(x, 0.5, out=np.empty_like(x))
    assert out.tolist() == [-3, 3] and x.tolist() == [-7, 7]


def test_scaling_checks_allow_integers_not_bool():
    dtypes.check_scaling(2.0, 1.0, "int32", "allreduce 'x'")
    dtypes.check_scaling(1.0, 1.0, "bool", "allreduce 'x'")      # factors of 1: nothing to do
    with pytest.raises(InvalidArgumentError, match="numeric"):
        dtypes.check_scaling(2.0, 1.0, "bool", "allreduce 'x'")


def test_executor_folds_average_into_the_postscale_factor_like_horovod():
    from lightcc.common.execution import reduction as shared

    sums = np.array([-49, -7, 5, 49, 100], np.int64)
    buf = sums.copy()
    shared.finish_scaling(buf, "average", "int64", 4, 1.5)
    assert buf.tolist() == [math.trunc(v * (1.5 / 4)) for v in sums.tolist()]
    buf = sums.copy()
    shared.finish_scaling(buf, "sum", "int64", 4, 0.3)
    assert buf.tolist() == [math.trunc(v * 0.3) for v in sums.tolist()]
    buf = sums.copy()                       # no factor: lightcc's exact integer average
    shared.finish_scaling(buf, "average", "int64", 49, 1.0)
    assert buf.tolist() == [-1, 0, 0, 1, 2]
