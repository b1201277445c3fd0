"""server/collab/compat: importing it changes nothing in hivemind; `install()` puts our 8-bit codec in hivemind's codec
table, and a second call changes nothing."""

import importlib
import sys

import pytest
from hivemind.compression import BlockwiseQuantization
from hivemind.compression import serialization as hivemind_serialization

import server.collab

MODULES = (
    "server.collab.compat",
    *(f"server.collab.compat.{name}" for name in ("codec", "runner", "process", "download", "averager")),
)

pytestmark = pytest.mark.timeout(30)


def test_importing_compat_patches_nothing_and_install_patches_once(monkeypatch):
    """Fresh copies of the package and of every submodule, imported over hivemind's own 8-bit codec. Fresh, not in a
    subprocess (unit tests start none): the copies other tests import, and may have installed, are put back after."""
    table = hivemind_serialization._BASE_COMPRESSION_TYPES
    originals = {name: importlib.import_module(name) for name in MODULES}
    hivemind_own = BlockwiseQuantization()
    monkeypatch.setitem(table, "BLOCKWISE_8BIT", hivemind_own)
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(server.collab, "compat", originals["server.collab.compat"])  # a fresh import rebinds it

    fresh = {name: importlib.import_module(name) for name in MODULES}
    assert all(fresh[name] is not originals[name] for name in MODULES)
    assert table["BLOCKWISE_8BIT"] is hivemind_own

    fresh["server.collab.compat"].install()
    installed = table["BLOCKWISE_8BIT"]
    assert type(installed) is fresh["server.collab.compat.codec"].TorchBlockwiseQuantization
    fresh["server.collab.compat"].install()
    assert table["BLOCKWISE_8BIT"] is installed
