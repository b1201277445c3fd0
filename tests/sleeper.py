"""A process that says it is waiting and then waits for ever, with swarm/stacks.py's SIGUSR1 handler: a stand-in for
a stuck peer (tests/integration/test_stacks.py)."""

import asyncio
import logging

import uvloop

from swarm import stacks


async def waiting_for_nothing() -> None:
    await asyncio.Event().wait()


async def main() -> None:
    stacks.dump_on_signal(asyncio.get_running_loop())
    task = asyncio.create_task(waiting_for_nothing(), name="the stuck task")
    logging.getLogger("sleeper").info("waiting")
    await task


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvloop.run(main())
