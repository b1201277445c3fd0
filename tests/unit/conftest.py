"""Unit tests start no process: no swarm, no DHT (hivemind's DHT and averagers are forked processes), no p2pd. Any
test here that tries fails at once and says to move it to tests/integration/."""

import multiprocessing.process
import os
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a unit test started a process: it belongs in tests/integration/")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)
