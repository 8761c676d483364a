"""A throw-away virtual cluster: one network namespace per worker, joined by veth pairs to a
bridge in the root namespace, each worker's link shaped with ``tc`` (token bucket) to a rate.

Only addresses inside these namespaces are used (the benchmark's own test hosts); everything
is removed on exit. Needs root and iproute2; :func:`available` says whether it can be made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

SUBNET = "10.213.{}.{}"  # addresses exist only inside the namespaces made here


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def available() -> tuple[bool, str]:
    """(True, "") when namespaces with shaped links can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "not root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return False, "iproute2 (ip, tc) not installed"
    try:
        with cluster(1, rate_mbit=1000):
            pass
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return False, f"cannot create network namespaces: {detail.strip()}"
    return True, ""


@dataclass
class Cluster:
    namespaces: list[str]
    addresses: list[str]
    rate_mbit: int
    interfaces: list[str] = field(default_factory=list)  # each worker's veth inside its ns

    def prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside worker ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank]]


@contextlib.contextmanager
def cluster(
    workers: int, *, rate_mbit: float, subnet: int = 7, delay_ms: float = 0.0
) -> Iterator[Cluster]:
    """Make ``workers`` namespaces whose egress is limited to ``rate_mbit`` Mbit/s each;
    ``delay_ms`` > 0 adds that one-way delay to every packet leaving a worker (``netem`` as
    the root qdisc, the rate limit below it), so a message between two workers costs at least
    the delay: a latency-bound link."""
    tag = uuid.uuid4().hex[:6]
    bridge = f"zpbr{tag}"
    made_ns: list[str] = []
    made_links: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_links.append(bridge)
        _ip("link", "set", bridge, "up")
        addresses: list[str] = []
        interfaces: list[str] = []
        for rank in range(workers):
            ns, host, peer = f"zp{tag}w{rank}", f"zp{tag}h{rank}", f"zp{tag}p{rank}"
            _ip("netns", "add", ns)
            made_ns.append(ns)
            _ip("link", "add", host, "type", "veth", "peer", "name", peer)
            made_links.append(host)
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", host, "master", bridge)
            _ip("link", "set", host, "up")
            addr = SUBNET.format(subnet, rank + 1)
            _ip("addr", "add", f"{addr}/24", "dev", peer, netns=ns)
            _ip("link", "set", peer, "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
            # egress shaping of the worker's link; the burst is large enough for the rate
            burst = max(64, int(rate_mbit // 8)) * 1024
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", peer]
            where = ["root"]
            if delay_ms > 0:
                subprocess.run(
                    [*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms",
                     "limit", "100000"],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                where = ["parent", "1:", "handle", "2:"]
            subprocess.run(
                [*tc, *where, "tbf", "rate", f"{round(rate_mbit * 1000)}kbit", "burst", str(burst),
                 "latency", "100ms"],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            addresses.append(addr)
            interfaces.append(peer)
        yield Cluster(made_ns, addresses, rate_mbit, interfaces)
    finally:
        for ns in made_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in made_links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
