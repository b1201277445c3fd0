"""How a stage call that fails ends: the gRPC status and message each kind of failure gets, in one table.

A caller learns why its call failed from these alone, never from a traceback, and a trainer acts on them
(trainer/trainer.py): RESOURCE_EXHAUSTED "admission: ..." sends the microbatch to another peer of stage 0, UNAVAILABLE
"behind: ..." asks again without banning the peer, DEADLINE_EXCEEDED counts as a timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NoReturn

import grpc

from server.collab import AdmissionRefused, Behind
from server.collab.tickets import TicketRefused, TicketUnchecked
from server.compute import DeadlineExpired
from swarm.protocol.frames import Busy
from swarm.protocol.tensors import WireError

MAX_STATUS_CHARS = 500  # status details travel in HTTP/2 trailers: a caller's oversized input must not make them fail


class Tally(Enum):
    """Which of a server's counters (in Info) a refusal adds to."""

    REJECTED = "requests_rejected"  # malformed, out of bounds or not admitted: the caller's fault
    BUSY = "requests_busy"  # too many calls or bytes held: the server's load


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    """How one kind of failure ends a Forward or Backward: with `code` and `message` (None: the exception's own text),
    counted in `tally`, and logged as a warning with `warning` (a %-format of the call's kind and the message) if
    set."""

    code: grpc.StatusCode
    message: str | None = None
    tally: Tally | None = None
    warning: str | None = None


# the first entry whose types the exception is an instance of decides (TicketRefused covers TicketSpent, Duplicate)
REFUSALS: tuple[tuple[type[Exception] | tuple[type[Exception], ...], Refusal], ...] = (
    (
        WireError,
        Refusal(code=grpc.StatusCode.INVALID_ARGUMENT, tally=Tally.REJECTED, warning="rejected %s request: %s"),
    ),
    (AdmissionRefused, Refusal(code=grpc.StatusCode.RESOURCE_EXHAUSTED)),
    ((Behind, TicketUnchecked), Refusal(code=grpc.StatusCode.UNAVAILABLE)),
    (TicketRefused, Refusal(code=grpc.StatusCode.PERMISSION_DENIED, tally=Tally.REJECTED, warning="refused %s: %s")),
    (Busy, Refusal(code=grpc.StatusCode.RESOURCE_EXHAUSTED, tally=Tally.BUSY)),
    (
        DeadlineExpired,
        Refusal(code=grpc.StatusCode.DEADLINE_EXCEEDED, message="deadline passed before computing; nothing computed"),
    ),
)


def refusal_of(e: Exception) -> Refusal | None:
    """How `e` ends the call; None for an exception no entry names: a bug, not the caller's doing."""
    return next((refusal for types, refusal in REFUSALS if isinstance(e, types)), None)


def shortened(message: str) -> str:
    """`message` cut to MAX_STATUS_CHARS."""
    return message if len(message) <= MAX_STATUS_CHARS else message[: MAX_STATUS_CHARS - 15] + "... (truncated)"


async def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with `code` and `message` (cut to MAX_STATUS_CHARS): grpc's abort raises, so nothing after this
    runs."""
    await context.abort(code, shortened(message))
    raise AssertionError("unreachable: ServicerContext.abort raises")
