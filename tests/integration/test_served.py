"""What a stage peer's admissions prove (server/collab/served.py): the samples its part may weigh in our parts of the
round. Stage 0's keys come from a stand-in for the DHT read (the signatures are real RSA, hivemind's)."""

from __future__ import annotations

import asyncio
import time
import types

from dht.identity import Identity
from server.collab.served import SIGNER_READ_S, Served
from server.collab.tickets import Tickets
from tests.unit.test_served import STAGE0, admission, progress, receiver


async def test_a_forgery_found_when_its_signer_is_read_counts_nothing_and_waiting_is_bounded():
    joiner = Identity()
    listed = [STAGE0]
    served = receiver(listed)
    await served.prove(progress("b", 5, admission("m1", 5)), 5)
    forged = admission("m2", 5, signer=Identity())  # names the joiner, signed by someone else
    forged.admitted_by = joiner.peer_id
    await served.prove(progress("b", 5, admission("m1", 5), forged), 5)
    listed.append(joiner)
    await served.settle(5)
    assert served.cap("b", 5, unheard=64.0) == 4.0 and served.forged == 1

    async def frozen(stage: int, include_pending: bool = False):
        await asyncio.sleep(3600)  # a DHT that never answers
        return []

    slow = Served(Tickets(types.SimpleNamespace(discover=frozen), timeout=30.0))
    t0 = time.monotonic()
    await slow.prove(progress("b", 5, forged), 5)
    await slow.settle(5)
    assert time.monotonic() - t0 < 2 * SIGNER_READ_S + 1.0
    assert slow.cap("b", 5, unheard=64.0) == 64.0
