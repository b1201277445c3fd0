"""The OS processes of a local swarm, for `swarm-local`, the integration tests and the benchmarks: what a server and a
trainer run with on one machine's loopback (`local_server`, `local_trainer`), each peer started as a child that dies
with its launcher (`dying_with_parent`, `Child`), and `LocalSwarm`, which starts them and stops every one of them.

Every child runs in a new session (its own process group) because hivemind's DHT forks a child and a p2pd daemon that
outlive a killed parent: stopping a peer means signalling its whole group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from server.config import AveragingConfig, ComputeConfig, EpochConfig, NetworkConfig, ServerConfig
from swarm.cli import to_argv
from swarm.protocol.access import SwarmKey
from trainer.config import TrainerConfig

# A child gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG = 1, kept across exec). A small Python program sets it
# in the child and execs the command; this used to run as Popen's preexec_fn, between fork and exec, where a launcher
# with threads (hivemind's, gRPC's) can leave a lock held that the child then waits for forever: seen in CI, a server
# that never started and wrote no log line.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('swarm-local: the launcher exited before this process started')\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


def dying_with_parent(argv: list[str]) -> list[str]:
    """The command line that runs `python argv...` and ends it with SIGTERM when this process (thread) exits."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


# What differs on one machine's loopback from a swarm across the internet: peers announce and poll often (records,
# progress and all-reduce groups form in fractions of a second here), and each process gets one torch thread because
# a dozen of them share the cores. A record outlives 6 announce periods: while a peer's DHT node is dead or frozen an
# announce can take 6 s (hivemind waits for that node), and an 8 s lifetime let healthy servers' records lapse.
def local_server(stage: int | str) -> ServerConfig:
    return ServerConfig(
        stage=str(stage),
        network=NetworkConfig(host="127.0.0.1", announce_period=2.0, record_ttl=12.0),
        compute=ComputeConfig(torch_threads=1),
        averaging=AveragingConfig(matchmaking_time=0.5),
        epochs=EpochConfig(progress_period=0.2),
    )


def local_trainer(stats_file: str | None = None) -> TrainerConfig:
    return TrainerConfig(log_period=10.0, stats_file=stats_file)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # pgid == pid: started with start_new_session


class LocalSwarm:
    """Starts and stops the processes of a local swarm. Use as a context manager: exit stops every process group."""

    def __init__(
        self, log_dir: Path, swarm_name: str = "local", model_args: list[str] | None = None, private: bool = False
    ):
        """`private`: a new swarm key in `log_dir`/swarm.key, given to every peer (swarm/protocol/access.py)."""
        self.log_dir, self.swarm_name = log_dir, swarm_name
        self.model_args = model_args or []
        self.children: dict[str, Child] = {}
        self.initial_peers: list[str] = []
        # child name -> the network namespace it runs in (`ip netns exec`; tests of NAT build their own namespaces)
        self.namespaces: dict[str, str] = {}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.key_args: list[str] = []  # --swarm-key FILE for every peer of a private swarm
        if private:
            SwarmKey.new().write(log_dir / "swarm.key")
            self.key_args = ["--swarm-key", str(log_dir / "swarm.key")]

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None or issubclass(exc_type, KeyboardInterrupt):
            self.stop_all()
            return
        # a test or a tool failed in here: say what each peer logged last, for a failure only a CI log will show; then
        # have each server and trainer write what it is doing into its log (swarm/stacks.py), and stop them
        for child in self.children.values():
            print(f"--- the last lines of {child.log_path}:\n{self.tail(child, 30)}", file=sys.stderr)
        for child in self.children.values():
            if child.alive() and child.name.startswith(("server", "trainer")):
                child.proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        self.stop_all()

    def spawn(self, name: str, module: str, args: list[str]) -> Child:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            namespace = ["ip", "netns", "exec", self.namespaces[name]] if name in self.namespaces else []
            proc = subprocess.Popen(
                [*namespace, *dying_with_parent(["-m", module, *args])],  # ip netns exec execs: the pid stays ours
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.children[name] = child = Child(name, proc, log_path)
        return child

    def start_dht(self, flags: Sequence[str] = (), timeout: float = 60.0) -> list[str]:
        """The swarm's bootstrap node (swarm-dht with `flags`); returns its multiaddrs once it runs."""
        maddr_file = self.log_dir / "dht.maddr"
        args = ["--host", "127.0.0.1", "--port", "0", "--maddr-file", str(maddr_file), "--swarm-name", self.swarm_name]
        args += [*self.key_args, *flags]
        child = self.spawn("dht", "dht.main", args)
        deadline = time.monotonic() + timeout
        while not maddr_file.exists():
            if not child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the DHT node did not start; see {child.log_path}:\n{self.tail(child)}")
            time.sleep(0.1)
        self.initial_peers = maddr_file.read_text().split()
        return self.initial_peers

    def start_monitor(self, port: int = 0, timeout: float = 60.0) -> str:
        """A swarm-monitor dashboard of this swarm on 127.0.0.1; returns its URL once it serves."""
        url_file = self.log_dir / "monitor.url"
        url_file.unlink(missing_ok=True)
        args = ["--swarm-name", self.swarm_name, "--initial-peers", *self.initial_peers, *self.key_args]
        child = self.spawn("monitor", "tools.monitor", [*args, "--port", str(port), "--url-file", str(url_file)])
        deadline = time.monotonic() + timeout
        while not url_file.exists():
            if not child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard did not start; see {child.log_path}:\n{self.tail(child)}")
            time.sleep(0.1)
        return url_file.read_text()

    def _common(self) -> list[str]:
        return [
            "--swarm-name",
            self.swarm_name,
            "--initial-peers",
            *self.initial_peers,
            *self.key_args,
            *self.model_args,
        ]

    def start_server(self, name: str, stage: int | str, extra: Sequence[str] = ()) -> Child:
        """`extra` flags override the local defaults (`local_server`): the last occurrence of a flag wins."""
        return self.spawn(name, "server.main", [*to_argv(local_server(stage)), *self._common(), *extra])

    def start_trainer(self, name: str, extra: Sequence[str] = ()) -> Child:
        return self.spawn(name, "trainer.main", [*to_argv(self.local_trainer(name)), *self._common(), *extra])

    def local_trainer(self, name: str) -> TrainerConfig:
        return local_trainer(str(self.log_dir / f"{name}.json"))

    def trainer_stats(self) -> list[dict]:
        out = []
        for name in self.children:
            path = self.log_dir / f"{name}.json"
            if name.startswith("trainer") and path.exists():
                with contextlib.suppress(ValueError, OSError):
                    out.append(json.loads(path.read_text()))
        return out

    def stop(self, names: list[str], grace: float = 15.0) -> None:
        """SIGTERM each peer, wait up to `grace`, then SIGKILL what is left of its group (orphans included).

        Only the group leader gets SIGTERM: it shuts its DHT child and p2pd down in order, while a SIGTERM to the whole
        group would kill them under its feet."""
        children = [self.children[n] for n in names if n in self.children]
        for child in children:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            child.signal_group(signal.SIGKILL)  # sweeps p2pd and DHT children left in the group
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)

    def stop_all(self, grace: float = 15.0) -> None:
        order = [n for n in self.children if n.startswith("trainer")]
        order += [n for n in self.children if n.startswith("server")]
        self.stop(order, grace)
        self.stop([n for n in self.children if n not in order], grace)

    @staticmethod
    def tail(child: Child, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(child.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""
