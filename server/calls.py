"""The Forward and Backward calls a server holds, and when a new one is turned away before it is read."""

from __future__ import annotations

import grpc

from server.config import GuardConfig
from swarm.protocol.frames import ADDRESS_SHARE_FACTOR


class CallCounts:
    """Calls between arrival and reply (event loop): in all, per caller and per address (swarm.protocol.frames
    `address_of`). A caller holds at most `max_caller_share` of `--max-active-calls`, and the callers of one address
    together ADDRESS_SHARE_FACTOR times that; only callers that hold calls are listed."""

    def __init__(self) -> None:
        self.active = 0
        self.by_caller: dict[str, int] = {}
        self.by_address: dict[str, int] = {}

    def turned_away(self, caller: str, address: str, guard: GuardConfig) -> tuple[grpc.StatusCode, str] | None:
        """RESOURCE_EXHAUSTED "busy: ..." if a new call would be more than the server, or this caller, or its
        address, holds at once."""
        held, from_address = self.by_caller.get(caller, 0), self.by_address.get(address, 0)
        share = guard.max_active_calls * guard.max_caller_share
        if self.active >= guard.max_active_calls:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy: {self.active} calls in progress"
        if held >= share or from_address >= min(guard.max_active_calls, ADDRESS_SHARE_FACTOR * share):
            whose = "this caller" if held >= share else "this address"
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy: {max(held, from_address)} calls of {whose} in progress"
        return None

    def hold(self, caller: str, address: str) -> None:
        self.active += 1
        for counts, key in ((self.by_caller, caller), (self.by_address, address)):
            counts[key] = counts.get(key, 0) + 1

    def release(self, caller: str, address: str) -> None:
        self.active -= 1
        for counts, key in ((self.by_caller, caller), (self.by_address, address)):
            if (left := counts.pop(key) - 1) > 0:
                counts[key] = left
