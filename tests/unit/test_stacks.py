"""What a stuck process is doing (swarm/stacks.py), and what a failed local swarm tells the CI log
(LocalSwarm.__exit__): real processes, real signals."""

import asyncio
import logging
import threading

from swarm import stacks


async def test_a_dump_from_another_thread_writes_the_threads_at_once_and_the_loop_logs_its_tasks(capfd, caplog):
    """What a server's move watchdog does (a timer thread, while the event loop may be stuck)."""

    async def the_stuck_move():
        await asyncio.Event().wait()

    move = asyncio.create_task(the_stuck_move(), name="the move")
    await asyncio.sleep(0)
    watchdog = threading.Thread(target=stacks.dump, args=("the move still runs", asyncio.get_running_loop()))
    with caplog.at_level(logging.WARNING, logger="swarm.stacks"):
        watchdog.start()
        watchdog.join()
        await asyncio.sleep(0.1)  # the loop runs the logging it was handed
    move.cancel()
    written = capfd.readouterr().err
    assert "--- stacks: the move still runs" in written and "Thread 0x" in written, written
    assert "the move still runs; " in caplog.text and "the move, waiting on" in caplog.text
    assert "in the_stuck_move" in caplog.text
