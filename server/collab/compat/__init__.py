"""Every private hivemind API this project relies on, in this package, written against the pinned hivemind==1.1.12.

An upgrade of hivemind means re-reading exactly what these modules touch, module by module:

`install()` (here) and codec.py:
- `hivemind.compression.serialization._BASE_COMPRESSION_TYPES` (its BLOCKWISE_8BIT entry replaced, by `install()`)
  and `BlockwiseQuantization`'s byte layout: 8-bit blockwise parts encoded and decoded by torch on the CPU.

runner.py:
- `AllReduceRunner` (subclassed): its constructor's arguments, `_communicate_with_peer` (replaced: with
  `_generate_input_for_peer`, `_get_peer_stub`, `should_delay_results`, `reducer_timeout`),
  `_accumulate_parts_streaming`, `_ban_sender` (replaced, with `banlock`), `tensor_part_reducer.accumulate_part` /
  `.num_parts`, `tensor_part_container` (`return_deltas`, `compression`, `failed_size`, `num_parts_by_peer`, `prefetch`,
  `register_processed_part`, `register_failed_reducer`, `_input_parts_by_peer`: the tensor of each of our parts, for
  its codec), `parts_for_local_averaging`, `sender_peer_ids`, `ordered_peer_ids`, `modes`, `weight`,
  `active_senders`, `all_senders_started`, `banned_senders`, `_future`: to hand every peer the same averaged values,
  and to fail a round with parts not averaged (at once, when a reducer fails);
- `TensorPartReducer` (subclassed): `check_current_part_finished` (replaced), `accumulate_part`, `finalize`,
  `finished`, `part_shapes`, `num_senders`, `current_part_index`, `current_part_accumulated_from`,
  `num_current_senders`, `current_part_future`, `sender_failed_after`, `accumulator`, `denominator`,
  `reset_accumulators`: a part reduced as a robust mean;
- `load_balance_peers` and `hagenbach_bishoff`: each peer's share of a round's values.

process.py:
- `DecentralizedAverager.run_in_background`, which sets SIGINT to "ignore" in the calling process for good;
- `DecentralizedAverager._shutdown` (extended) and `._p2p` (a `P2P.replicate` that hivemind never closes).

download.py:
- `DecentralizedAverager._outer_pipe` (calls into the averager's process), `.get_stub`, `._p2p`, `.prefix`,
  `.serializer` and the `rpc_download_state` RPC (its messages, ended by our STATE_END): to download the state of
  one named peer;
- `DecentralizedAverager._declare_for_download_periodically` (replaced), `.declare_state_period`,
  `.allow_state_sharing`, `.state_sharing_priority`, `._state_updated`, `._matchmaking.group_key_manager.prefix`:
  the same declarations, with each DHT store's failure read instead of left to asyncio's "never retrieved".

averager.py:
- `DecentralizedAverager._run_allreduce_inplace_` (replaced: it builds our runner and copies its results in),
  `._aggregate_with_group` (replaced: it checks the group's gathered round data and picks the tensors to average),
  `.serializer`, `.peer_id`, `.get_tensors`, `GroupInfo.gathered` (each peer's [bandwidth, mode, gathered bytes]);
  `._running_groups`, `._averaging_alpha`, `.last_updated`, `._state_updated`;
- `DecentralizedAverager._outer_pipe` (calls into the averager's process: `_expect_group`, `_fix_group`,
  `_cap_weights`);
- `DecentralizedAverager.rpc_join_group` (extended), `._matchmaking.group_key_manager.get_averagers` (wrapped),
  `._matchmaking.target_group_size`: to keep peers the stage does not list out of its groups;
- `Matchmaking.look_for_group` (wrapped), `StepControl.data_for_gather`, `GroupInfo`, `._running_groups`,
  `._allreduce_timeout` and `DecentralizedAverager.rpc_aggregate_part` (extended): fixed groups, which skip
  matchmaking; with `AllReduceRunner.finalize` and `._register_allreduce_group` (extended), rounds that give way to a
  member's other round;
- `DecentralizedAverager.rpc_download_state` (extended), `.dht`, and the DHT node's
  `protocol.routing_table.peer_id_to_uid`: in private swarms, to serve our state only to peers that proved the swarm
  key to our DHT node, or that the stage's records list.

Importing these modules changes nothing in hivemind: `install()` does, once per process, before any averager forks
or any 8-bit all-reduce part is encoded or decoded (server/main.py calls it at start-up, and every averager of ours
as it is built: process.py `ClosesReplica`).
"""

from __future__ import annotations

import logging

import hivemind
from hivemind.compression import serialization as hivemind_serialization

logger = logging.getLogger(__name__)
PINNED_VERSION = "1.1.12"


def check_version() -> None:
    if hivemind.__version__ != PINNED_VERSION:
        logger.warning(
            "hivemind %s is installed; server/collab/compat/ was written against %s",
            hivemind.__version__,
            PINNED_VERSION,
        )


def install() -> None:
    """Put our codecs in hivemind's tables; idempotent (a second call changes nothing). Every 8-bit blockwise tensor
    a hivemind averager of ours sends or receives, in this process and the averager processes it forks, is then
    encoded and decoded by TorchBlockwiseQuantization: hivemind serializes through this table."""
    from server.collab.compat.codec import TorchBlockwiseQuantization  # codec.py's warm_up_8bit calls install()

    table = hivemind_serialization._BASE_COMPRESSION_TYPES
    if not isinstance(table["BLOCKWISE_8BIT"], TorchBlockwiseQuantization):
        table["BLOCKWISE_8BIT"] = TorchBlockwiseQuantization()
