"""Algorithms across simulated hosts: network namespaces joined by 1 Gbit tbf-shaped links.

Skips (with the reason) where namespaces cannot be created: not Linux, not root, no iproute2.
Nodes come from host names here (every namespace has its own), not from LCC_LOCAL_SIZE, so
this also checks topology detection across real TCP between "hosts".
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.netns.simhosts import SimHosts, unavailable_reason

WORKER = str(Path(__file__).resolve().parent.parent / "parallel" / "workers_algorithms"
             / "check_algorithms.py")

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def sim():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"simulated hosts unavailable: {reason}")
    with SimHosts(2, "1gbit", tag=f"lcct{os.getpid()}") as hosts:   # removed even if a test fails
        yield hosts


@pytest.mark.parametrize("per_host", [1, 2], ids=["2x1", "2x2"])
def test_algorithms_across_namespaces(sim: SimHosts, per_host: int) -> None:
    res = sim.run(per_host, [WORKER, "0", "--quick"], timeout=200, btl="tcp,sm,self")
    assert res.returncode == 0, res.stdout[-6000:]
    nodes = "(0, 1)" if per_host == 1 else "(0, 0, 1, 1)"
    assert f"nodes={nodes}" in res.stdout, res.stdout[-3000:]


def test_uneven_hosts_and_plain_tcp(sim: SimHosts) -> None:
    """3 ranks on 2 hosts (2 + 1) over TCP only (no shared memory), one link per peer."""
    res = sim.run(0, [WORKER, "0", "--quick"], timeout=200, num_links=1, btl="tcp,self",
                  slots=[2, 1])
    assert res.returncode == 0, res.stdout[-6000:]
    assert "nodes=(0, 0, 1)" in res.stdout, res.stdout[-3000:]


def test_namespaces_are_removed() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"simulated hosts unavailable: {reason}")
    import subprocess

    with SimHosts(2, None, tag=f"lccg{os.getpid()}") as s:
        names = [s.switch, *s.hosts]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed
