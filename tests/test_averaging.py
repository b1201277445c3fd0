"""hivemind's averager, with the codecs we use, really averages. Regression test for a known silent failure: with
numpy >= 2.4, hivemind's 8-bit codecs fail on decode inside the averager, which swallows the error: step() returns and
nothing is averaged. Two DHT nodes give the two averagers separate identities inside one test process."""

import threading

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import get_dht_time

from dht.node import start_dht
from server.collab.averaging import hivemind_compression
from swarm.compression import get_codec

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("codec", ["none", "blockwise8"])
def test_two_peers_average_for_real(codec):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(50_000, generator=gen), torch.randn(50_000, generator=gen)
    boot = start_dht()
    dhts = [start_dht([str(m) for m in boot.get_visible_maddrs()]) for _ in range(2)]
    averagers = [
        DecentralizedAverager(
            [t.clone()],
            dht,
            prefix=f"avgtest_{codec}",
            start=True,
            min_matchmaking_time=1.0,
            request_timeout=0.5,
            compression=hivemind_compression(get_codec(codec)),
            target_group_size=2,
        )
        for t, dht in zip((a, b), dhts, strict=True)
    ]
    try:
        when = get_dht_time() + 1.0
        results = [None, None]

        def step(i: int) -> None:
            results[i] = averagers[i].step(weight=1.0 + i, scheduled_time=when, timeout=30)

        threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r is not None for r in results), "the all-reduce did not form a group"
        expected = (a + 2 * b) / 3  # weighted by 1 and 2
        for averager in averagers:
            with averager.get_tensors() as (got,):
                err = ((got - expected).norm() / expected.norm()).item()
                moved = min((got - a).norm().item(), (got - b).norm().item()) / expected.norm().item()
            assert moved > 0.3, "values did not change: the averager did nothing"
            assert err < (1e-6 if codec == "none" else 3e-2), err
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in (*dhts, boot):
            dht.shutdown()
