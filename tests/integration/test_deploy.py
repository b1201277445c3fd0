"""Static checks of deploy/: the compose file, the Dockerfile and the console scripts they run agree with each other.

Fast and offline: nothing is built or started. `docker compose config` is run only where a compose binary exists.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_deploy import COMPOSE, ROOT


def compose_command() -> list[str] | None:
    """`docker compose` (the CLI plugin), else a standalone `docker-compose` on PATH or beside this Python."""
    candidates = [["docker", "compose"], ["docker-compose"], [str(Path(sys.executable).parent / "docker-compose")]]
    for command in candidates:
        if shutil.which(command[0]) is None:
            continue
        try:
            probe = subprocess.run([*command, "version"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return command
    return None


@pytest.mark.timeout(120)
def test_docker_compose_accepts_the_file():
    command = compose_command()
    if command is None:
        pytest.skip("no working `docker compose` / `docker-compose` on this machine")
    result = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
