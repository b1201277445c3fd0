"""What a process is doing when it seems stuck: every thread's stack, and where each pending asyncio task waits.

`kill -USR1 <pid>` of a swarm-server or swarm-trainer writes both to its log (stderr). The threads come from
faulthandler, in C, so they are written even when the event loop itself is blocked; the tasks are written by the loop,
when it next runs. A server also writes them on its own when a move between stages outlasts its bound."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys

logger = logging.getLogger(__name__)


def await_chain(coro) -> list[str]:
    """Where a coroutine is suspended: the frame of each coroutine it awaits, outermost first (a task's own stack
    shows only the outermost)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return lines


def describe_tasks(tasks: list[asyncio.Task]) -> str:
    """Each pending task: its name, what it waits on, and its chain of awaits."""
    out = [f"{len(tasks)} pending asyncio tasks:"]
    for task in tasks:
        out.append(f"  {task.get_name()}, waiting on {task._fut_waiter!r:.200}:")  # type: ignore[attr-defined]
        out.extend(f"    {line}" for line in await_chain(task.get_coro()))
    return "\n".join(out)


def dump(reason: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Any thread: write every thread's stack to stderr now, and `loop`'s pending tasks (logged) when it next runs."""
    out = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr  # the process's own stderr: its log
    print(f"--- stacks: {reason}", file=out, flush=True)
    faulthandler.dump_traceback(file=out, all_threads=True)
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(log_tasks, reason)


def log_tasks(reason: str) -> None:
    """Event loop: log its pending tasks."""
    tasks = [t for t in asyncio.all_tasks() if not t.done()]
    logger.warning("%s; %s", reason, describe_tasks(tasks))


def dump_on_signal(loop: asyncio.AbstractEventLoop, signum: int = signal.SIGUSR1) -> None:
    """Event loop: on `signum`, faulthandler writes the threads at once, then hands the signal on to the loop's own
    handler, which logs the tasks (see the module's docstring)."""
    loop.add_signal_handler(signum, log_tasks, f"signal {signal.Signals(signum).name}")
    faulthandler.register(signum, all_threads=True, chain=True)
