"""A home router on one machine: network namespaces, veth pairs and a masquerading router (iproute2 and iptables,
as root). Nothing is bound outside the namespaces the test makes; they are deleted when it ends.

    wan  (11.0.0.1)  ---  router (11.0.0.2 | 192.168.7.1, MASQUERADE out of its wan side)  ---  home (192.168.7.2)

`wan` is "the internet": the bootstrap node, public servers and trainers. `home` reaches it through the router's
NAT; nothing in `wan` can open a connection to `home` (it has no route there, and the router forwards no port).
11.0.0.0/24 is used, not a documentation range, because libp2p treats those as unroutable and would not dial them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

WAN_HOST, ROUTER_WAN, ROUTER_LAN, HOME_HOST = "11.0.0.1", "11.0.0.2", "192.168.7.1", "192.168.7.2"


@dataclasses.dataclass(frozen=True)
class HomeRouter:
    wan: str  # namespace names
    router: str
    home: str

    def add_wan_host(self, address: str) -> None:
        """Another address of "the internet" (11.0.0.3 to 11.0.0.254), on the wan namespace's interface: peers bound
        there count as other machines (libp2p trusts the address it is seen at once peers at 4 addresses agree)."""
        _run("ip", "-n", self.wan, "addr", "add", f"{address}/24", "dev", f"w{self.wan.removeprefix('swarmwan')}")


def unavailable() -> str | None:
    """Why this machine cannot build the namespaces (the reason a test skips with), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install iproute2 iptables)"
    probe = f"swarmprobe{uuid.uuid4().hex[:6]}"
    if (error := _run_quiet("ip", "netns", "add", probe)) is not None:
        return f"cannot create a network namespace: {error}"
    try:
        nat = _run_quiet("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L")
        return None if nat is None else f"no NAT table in a namespace: {nat}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _run_quiet(*argv: str) -> str | None:
    """Runs a command; None if it succeeded, else what it printed."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else (done.stderr or done.stdout).strip()


def _run(*argv: str) -> None:
    if (error := _run_quiet(*argv)) is not None:
        raise RuntimeError(f"{' '.join(argv)}: {error}")


@contextlib.contextmanager
def home_router() -> Iterator[HomeRouter]:
    """Builds the three namespaces above; deletes them (and their veth pairs) on exit, even on failure. Processes
    started in them must have ended first (LocalSwarm's exit does that)."""
    tag = uuid.uuid4().hex[:6]  # several runs on one machine do not collide; interface names stay under 16 bytes
    net = HomeRouter(wan=f"swarmwan{tag}", router=f"swarmrtr{tag}", home=f"swarmhome{tag}")
    made: list[str] = []
    try:
        for namespace in dataclasses.astuple(net):
            _run("ip", "netns", "add", namespace)
            made.append(namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
        for a_ns, a_if, a_ip, b_ns, b_if, b_ip in (
            (net.wan, f"w{tag}", WAN_HOST, net.router, f"rw{tag}", ROUTER_WAN),
            (net.router, f"rl{tag}", ROUTER_LAN, net.home, f"h{tag}", HOME_HOST),
        ):
            _run("ip", "link", "add", a_if, "type", "veth", "peer", "name", b_if)
            for namespace, interface, address in ((a_ns, a_if, a_ip), (b_ns, b_if, b_ip)):
                _run("ip", "link", "set", interface, "netns", namespace)
                _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
                _run("ip", "-n", namespace, "link", "set", interface, "up")
        _run("ip", "-n", net.home, "route", "add", "default", "via", ROUTER_LAN)
        _run("ip", "netns", "exec", net.router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _run("ip", "netns", "exec", net.router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", f"rw{tag}", "-j",
             "MASQUERADE")  # fmt: skip
        yield net
    finally:
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def dials(namespace: str, host: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a TCP connection from inside `namespace` to host:port succeeds (a listener must be there)."""
    code = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {port}), timeout={timeout}).close()\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    done = subprocess.run(["ip", "netns", "exec", namespace, "python3", "-c", code], capture_output=True)
    return done.returncode == 0


@contextlib.contextmanager
def listener(namespace: str, host: str) -> Iterator[int]:
    """A TCP listener inside `namespace` on host (any port), accepting until the block ends; yields its port."""
    code = (
        "import socket, sys\n"
        f"s = socket.create_server(({host!r}, 0))\n"
        "print(s.getsockname()[1], flush=True)\n"
        "while True:\n"
        "    s.accept()[0].close()\n"
    )
    proc = subprocess.Popen(
        ["ip", "netns", "exec", namespace, "python3", "-c", code], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield port
    finally:
        proc.kill()
        proc.wait()
