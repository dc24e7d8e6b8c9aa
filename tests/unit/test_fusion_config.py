"""Fusion planning, configuration parsing, dtype rules and topology assignment (no MPI)."""
from __future__ import annotations

import pytest

from lightcc.common import config, dtypes, topology
from lightcc.common.control.messages import Coll, Request, Response
from lightcc.common.exceptions import ConfigError, UnsupportedDTypeError
from lightcc.common.execution import fusion


def resp(name, n, dtype="float32", op="sum", coll=Coll.ALLREDUCE, error="", **kw):
    return Response(Request(coll, name, dtype, (n,), op, **kw), error=error)


def test_plan_fuses_compatible_responses_up_to_threshold():
    rs = [resp("a", 10), resp("b", 10), resp("c", 10)]
    assert fusion.plan(rs, 80) == [[0, 1], [2]]
    assert fusion.plan(rs, 1 << 20) == [[0, 1, 2]]


def test_plan_separates_dtypes_ops_scales_and_other_collectives():
    rs = [resp("a", 4), resp("b", 4, dtype="float64"), resp("c", 4, op="max"),
          resp("d", 4, prescale=2.0), resp("e", 4, coll=Coll.ALLGATHER), resp("f", 4),
          resp("g", 4, error="boom"), resp("h", 4, compression="fp16")]
    buckets = fusion.plan(rs, 1 << 20)
    assert [0, 5] in buckets
    assert sorted(i for b in buckets for i in b) == list(range(len(rs)))
    assert all(len(b) == 1 for b in buckets if b != [0, 5])


def test_plan_large_tensor_gets_own_bucket_never_truncated():
    rs = [resp("small", 2), resp("huge", 1000), resp("small2", 2)]
    assert fusion.plan(rs, 64) == [[0, 2], [1]]


def test_plan_in_place_rule_on_one_host_only():
    big = fusion.DIRECT_BYTES // 4               # float32 elements of a DIRECT_BYTES tensor
    rs = [resp("small", 2), resp("big", big), resp("small2", 2)]
    assert fusion.plan(rs, 1 << 30) == [[0, 2], [1]]               # default: in place, alone
    assert fusion.direct_bytes(1) == (fusion.DIRECT_BYTES, 0)
    assert fusion.plan(rs, 1 << 30, 0, *fusion.direct_bytes(2)) == [[0, 1, 2]]   # fused across hosts
    assert fusion.plan(rs, 1 << 30, direct=4 * big + 4) == [[0, 1, 2]]   # below the bound


def test_plan_across_hosts_large_tensors_go_alone_compressed_or_not():
    direct = fusion.direct_bytes(2)
    assert direct == (fusion.MULTI_HOST_DIRECT_BYTES, fusion.MULTI_HOST_DIRECT_BYTES)
    large = fusion.MULTI_HOST_DIRECT_BYTES // 4          # float32 elements
    for comp in ("none", "fp16", "topk"):
        rs = [resp("s1", 100, compression=comp), resp("L1", large, compression=comp),
              resp("s2", 100, compression=comp), resp("L2", large - 1, compression=comp)]
        assert fusion.plan(rs, 1 << 30, 0, *direct) == [[0, 2, 3], [1]], comp
        # on one host, compressed tensors stay fused; uncompressed large ones go alone
        one = fusion.plan(rs, 1 << 30, 0, *fusion.direct_bytes(1))
        assert one == ([[0, 2], [1], [3]] if comp == "none" else [[0, 1, 2, 3]]), comp


def test_plan_prioritized_buckets_double_from_a_small_first_one(monkeypatch):
    """Prioritized allreduces (cross-barrier mode) fill buckets of 1, 2, 4, ... units (the
    first needed first travels alone), up to the threshold; unprioritized ones are fused as
    before, in their own buckets. Expected buckets worked out by hand for a 40-byte unit."""
    monkeypatch.setattr(fusion, "PRIORITY_BUCKET_BYTES", 40)
    rs = [resp(f"p{i}", 5, priority=i + 1) for i in range(10)]        # 20 bytes each
    rs.append(resp("plain", 5))
    # units: 40 -> [0, 1]; 80 -> [2..5]; 160 capped by the 100-byte threshold -> [6..9]
    assert fusion.plan(rs, 100) == [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    assert fusion.plan(rs, 1 << 20) == [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    # without priorities, the same tensors fill the threshold at once
    flat = [resp(f"p{i}", 5) for i in range(10)]
    assert fusion.plan(flat, 100) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_plan_threshold_zero_disables_fusion():
    rs = [resp("a", 1), resp("b", 1)]
    assert fusion.plan(rs, 0) == [[0], [1]]


def test_fusion_buffer_reused():
    """One allocation per dtype, reused by every smaller request; a larger one replaces it
    (and is reused from then on); dtypes never share memory; release() frees everything."""
    import numpy as np

    fb = fusion.FusionBuffer()
    a = fb.get("float32", 10)
    b = fb.get("float32", 5)
    assert a.shape == (10,) and b.shape == (5,) and a.dtype == b.dtype == np.float32
    assert b.base is not None and b.base is a.base            # views of one buffer
    assert np.shares_memory(a, b) and b.ctypes.data == a.ctypes.data
    assert fb.nbytes == 40                                    # nothing allocated for b
    big = fb.get("float32", 20)
    assert big.size == 20 and fb.nbytes == 80 and not np.shares_memory(big, a)
    again = fb.get("float32", 7)
    assert again.ctypes.data == big.ctypes.data and again.base is big.base
    other = fb.get("float64", 3)
    assert other.dtype == np.float64 and not np.shares_memory(other, big)
    assert fb.nbytes == 80 + 24
    fb.release()
    assert fb.nbytes == 0 and not np.shares_memory(fb.get("float32", 5), big)


def test_config_defaults_and_env():
    cfg = config.load({}, environ={})
    assert cfg.fusion_threshold == 64 * 1024 * 1024 and cfg.cycle_time == 1.0
    cfg = config.load({}, environ={"LCC_FUSION_THRESHOLD": "1024", "LCC_CYCLE_TIME": "2.5",
                                   "LCC_CPU_REDUCE": "yes"})
    assert cfg.fusion_threshold == 1024 and cfg.cycle_time == 2.5 and cfg.cpu_reduce


def test_config_overrides_beat_env():
    cfg = config.load({"fusion_threshold": 7}, environ={"LCC_FUSION_THRESHOLD": "1024"})
    assert cfg.fusion_threshold == 7


@pytest.mark.parametrize("env,needle", [
    ({"LCC_FUSION_THRESHOLD": "lots"}, "LCC_FUSION_THRESHOLD='lots' is not valid"),
    ({"LCC_FUSION_THRESHOLD": "-1"}, "must be >= 0"),
    ({"LCC_CYCLE_TIME": "nan"}, "LCC_CYCLE_TIME"),
    ({"LCC_LOG_LEVEL": "loud"}, "must be one of"),
    ({"LCC_COMPRESSION": "zip"}, "unknown compressor"),
    ({"LCC_ALGORITHM": "magic"}, "unknown algorithm"),
    ({"LCC_CPU_REDUCE": "maybe"}, "LCC_CPU_REDUCE"),
])
def test_invalid_env_values_give_clear_errors(env, needle):
    with pytest.raises(ConfigError, match=None) as info:
        config.load({}, environ=env)
    assert needle in str(info.value)


def test_unknown_init_keyword():
    with pytest.raises(ConfigError, match="unknown setting"):
        config.load({"fusion_treshold": 1}, environ={})


def test_markdown_table_lists_every_variable():
    table = config.markdown_table()
    for knob in config.KNOBS:
        assert f"`{knob.env}`" in table


def test_dtype_rules():
    assert dtypes.reduce_dtype("float16") == dtypes.SUPPORTED["float32"]
    assert dtypes.reduce_dtype("bool").name == "uint8"
    assert dtypes.backend_op("average", "float32") == "sum"
    assert dtypes.backend_op("sum", "bool") == "max"
    with pytest.raises(UnsupportedDTypeError, match="complex64"):
        dtypes.name_of("complex64")
    with pytest.raises(UnsupportedDTypeError, match="Average"):
        dtypes.check_op("average", "bool", "allreduce 'x'")


def test_assign_nodes_by_local_size_and_hostname():
    assert topology.assign_nodes(["h"] * 3, 2) == (0, 0, 1)
    assert topology.assign_nodes(["a", "b", "a", "b"], 0) == (0, 1, 0, 1)
