"""Simulated hosts on one machine: Linux network namespaces behind a rate-limited switch.

``SimHosts(n, rate)`` creates ``n`` "host" namespaces and one "switch" namespace holding a
bridge; host ``i`` gets a veth link ``lcc0`` with address ``10.77.0.{i+1}/24`` (a private
subnet that exists only inside these namespaces) plugged into the bridge. Both directions of
every host link are shaped with ``tc qdisc ... tbf`` at ``rate`` (netem is not used), so a host
behaves like a machine with one full-duplex NIC of that speed.

``mpirun_cmd`` builds an Open MPI 5 (PRRTE) command line that starts ``mpirun`` inside host
0's namespace and the other hosts' daemons through ``netns_agent.sh`` (given as the
``plm_ssh_agent``), with ``btl tcp,self`` bound to ``lcc0`` so rank traffic between hosts
really crosses the shaped links. Namespaces are removed on ``close()`` / context exit, and an
``atexit`` hook removes them if the process dies of an exception.

Command line (root): ``python -m tests.netns.simhosts --hosts 2 --rate 1gbit -- CMD...``
runs ``CMD`` with ``LCC_SIMHOSTS_MPIRUN`` set to the mpirun prefix (see docs/topology.md).
"""
from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
AGENT = HERE / "netns_agent.sh"
SUBNET = "10.77.0"
IFACE = "lcc0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def rate_bits(rate: str) -> int:
    """``"1gbit"`` -> 1e9, ``"100mbit"`` -> 1e8 (bits per second)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 1gbit, 10gbit, 500mbit")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (``None`` when they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (apt-get install -y iproute2)"
    probe = f"lccprobe{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"'ip netns add' failed: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class SimHosts:
    """``n`` host namespaces on a bridge, links shaped to ``rate`` (e.g. ``"1gbit"``)."""

    def __init__(self, n: int = 2, rate: str | None = "1gbit", tag: str | None = None,
                 mtu: int = 1500) -> None:
        if not 2 <= n <= 200:
            raise ValueError(f"hosts must be in 2..200, got {n}")
        self.n = n
        self.rate = rate
        self.mtu = mtu
        self.tag = tag or f"lcc{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self._created: list[str] = []
        atexit.register(self.close)
        try:
            self._setup()
        except Exception:
            self.close()
            raise

    # -- lifecycle ---------------------------------------------------------------------------
    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        if not self.rate:
            return
        bps = rate_bits(self.rate)
        burst = max(32 * 1024, bps // 8 // 1000)            # ~1 ms of line rate, bytes
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                        "tbf", "rate", self.rate, "burst", str(burst), "latency", "20ms"],
                       check=True, capture_output=True, text=True)

    def _setup(self) -> None:
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "lccbr", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "lccbr", "up")
        for i, (ns, addr) in enumerate(zip(self.hosts, self.addrs)):
            self._netns(ns)
            port = f"p{i}"
            _ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", self.switch, "link", "set", port, "master", "lccbr")
            _ip("-n", self.switch, "link", "set", port, "up")
            if self.mtu != 1500:
                _ip("-n", ns, "link", "set", IFACE, "mtu", str(self.mtu))
                _ip("-n", self.switch, "link", "set", port, "mtu", str(self.mtu))
            self._shape(ns, IFACE)
            self._shape(self.switch, port)

    def close(self) -> None:
        """Delete every namespace this object created (their veths go with them)."""
        while self._created:
            _ip("netns", "del", self._created.pop(), check=False)

    def __enter__(self) -> "SimHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running -------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Variables the launch agent needs (address -> namespace map)."""
        return {"LCC_NETNS_HOSTS": ",".join(f"{a}={h}" for a, h in zip(self.addrs, self.hosts))}

    def mpirun_cmd(self, ranks_per_host: int, num_links: int | None = 2,
                   mpirun: str | None = None, extra: list[str] | None = None,
                   btl: str = "tcp,self", slots: list[int] | None = None) -> list[str]:
        """The command prefix starting ``n * ranks_per_host`` ranks, block-mapped to hosts.

        ``slots`` gives ranks per host instead (e.g. ``[2, 1]`` for uneven hosts).

        ``num_links`` sets ``btl_tcp_links`` (parallel TCP connections per peer pair; ``None``
        keeps Open MPI's default of 1). ``btl="tcp,sm,self"`` lets ranks on the same simulated
        host use shared memory (each host has its own host name, so Open MPI only pairs ranks
        of one namespace over ``sm``); between hosts traffic always takes ``lcc0``.
        """
        mpirun = mpirun or str(Path(sys.executable).parent / "mpirun")
        if not Path(mpirun).exists():
            mpirun = shutil.which("mpirun") or "mpirun"
        slots = list(slots) if slots else [ranks_per_host] * self.n
        hosts = ",".join(f"{a}:{k}" for a, k in zip(self.addrs, slots) if k > 0)
        cmd = ["ip", "netns", "exec", self.hosts[0], "unshare", "--uts", "/bin/sh", "-c",
               f'hostname {self.hosts[0]}; exec "$@"', "sh", mpirun, "--allow-run-as-root",
               "-np", str(sum(slots)), "-H", hosts, "--bind-to", "none",
               "--prtemca", "plm_ssh_agent", str(AGENT),
               "--mca", "pml", "ob1", "--mca", "btl", btl,
               "--mca", "btl_tcp_if_include", IFACE, "--mca", "oob_tcp_if_include", IFACE,
               "--mca", "mpi_yield_when_idle", "1"]
        if num_links is not None:
            cmd += ["--mca", "btl_tcp_links", str(num_links)]
        return cmd + list(extra or [])

    def run(self, ranks_per_host: int, args: list[str], env: dict[str, str] | None = None,
            timeout: float = 120, num_links: int | None = 2,
            extra: list[str] | None = None, btl: str = "tcp,self",
            slots: list[int] | None = None) -> subprocess.CompletedProcess:
        """Run ``args`` on every rank; stdout+stderr merged; raises on timeout."""
        full_env = dict(os.environ)
        repo = str(HERE.parent.parent)
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, full_env.get("PYTHONPATH")]))
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env.update(self.env())
        full_env.update(env or {})
        if args and args[0].endswith(".py"):
            args = [sys.executable, *args]
        cmd = self.mpirun_cmd(ranks_per_host, num_links, extra=extra, btl=btl, slots=slots) + args
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=full_env, timeout=timeout, start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="tbf rate per link, e.g. 1gbit, 10gbit")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--num-links", type=int, default=2)
    parser.add_argument("--btl", default="tcp,sm,self",
                        help="Open MPI btl list (default tcp,sm,self: shared memory between "
                             "the ranks of one simulated host, as on a real one)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- program and arguments")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"simhosts: {reason}", file=sys.stderr)
        return 2
    cmd = [c for c in args.cmd if c != "--"] or ["hostname"]
    with SimHosts(args.hosts, args.rate) as sim:
        res = sim.run(args.ranks_per_host, cmd, num_links=args.num_links, timeout=3600,
                      btl=args.btl)
        sys.stdout.write(res.stdout)
        return res.returncode


if __name__ == "__main__":
    sys.exit(main())
