"""The direct path's pure logic (lightcc/common/execution/direct.py): which calls are reduced there, and
the verdict every rank draws from the summed headers. Multi-rank runs: tests/parallel/test_core.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightcc.common import config
from lightcc.common.execution.direct import _HEADER, DirectPath, _Plan, eligible


def test_eligible_follows_size_limit_and_compression_threshold():
    assert eligible(4, "none", 4096, 65536)
    assert eligible(65536, "none", 4096, 65536)
    assert not eligible(65537, "none", 4096, 65536)
    assert eligible(1024, "fp16", 4096, 65536)         # too small to be compressed
    assert not eligible(4096, "fp16", 4096, 65536)     # the engine compresses it
    assert not eligible(4, "none", 4096, 0)            # LCC_DIRECT_BYTES=0: off


def test_direct_bytes_knob_default_and_validation():
    assert config.load({}, environ={}).direct_bytes == 64 * 1024
    assert config.load({}, environ={"LCC_DIRECT_BYTES": "0"}).direct_bytes == 0
    with pytest.raises(Exception, match="LCC_DIRECT_BYTES"):
        config.load({}, environ={"LCC_DIRECT_BYTES": "-1"})


def _sums(headers: list) -> np.ndarray:
    total = np.zeros(_HEADER, np.int64)
    for h in headers:
        total += h
    return total


SIGS = [("float32", (4,), "sum", 1.0, 1.0, "none", "host", True),
        ("float32", (5,), "sum", 1.0, 1.0, "none", "host", True),
        ("float64", (4,), "sum", 1.0, 1.0, "none", "host", True),
        ("float32", (4,), "max", 1.0, 1.0, "none", "host", True),
        ("float32", (4,), "sum", 2.0, 1.0, "none", "host", True),
        ("float32", (4,), "sum", 1.0, 1.0, "fp16", "host", True),
        ("float32", (4,), "sum", 1.0, 1.0, "none", "GPU", False),
        ("float32", (20000,), "sum", 1.0, 1.0, "none", "host", False),
        ("int32", (2, 2), "average", 1.0, 1.0, "none", "host", True)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(range(len(SIGS))), min_size=1, max_size=9),
       st.integers(0, 4))
def test_verdict_is_agreement_exactly_when_the_callers_signatures_are_equal(picks, joined):
    """Ranks that call contribute their header, joined ranks zeros; the sums say "agree"
    exactly when every caller had the same signature (no rank can be fooled by others)."""
    size = len(picks) + joined
    headers = [_Plan(SIGS[i], size).header for i in picks] + [np.zeros(_HEADER, np.int64)] * joined
    total = _sums(headers)
    assert int(total[0]) == len(picks)
    assert DirectPath._agree(total) == (len(set(picks)) == 1)


def test_all_joined_is_a_zero_header_and_agreement_gives_the_payload_shape():
    assert DirectPath._agree(np.zeros(_HEADER, np.int64))
    plan = _Plan(("int32", (2, 3), "average", 1.0, 1.0, "none", "host", True), 3)
    total = _sums([plan.header, plan.header])           # two callers, one joined rank
    m = int(total[0])
    assert DirectPath._agree(total) and m == 2
    assert int(total[9]) // m == 6                       # elements, for the joined rank's zeros
    assert int(total[11]) // m == 1                      # and the payload follows here
    assert total.tobytes() != plan.agreed               # not the all-members fast path
    assert _sums([plan.header] * 3).tobytes() == plan.agreed
