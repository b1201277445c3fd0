"""What a stage server tells Prometheus (swarm/metrics.py): read from its worker, service and collaboration at each
scrape, on the metrics thread. Reads only; a value may be one update behind another."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.metrics import Families

if TYPE_CHECKING:
    from server.stage_server import StageServer


def fill_server_metrics(server: StageServer, f: Families) -> None:
    f.gauge("server_state", "1 for the state the peer is in", 1, state=server.state.value)
    f.counter("server_moves", "stages this peer left for another (rebalancing)", server.moves)
    active, endpoint = server._active, server._endpoint
    if active is None:  # still building its first stage
        return
    w, collab, stage = active.worker, active.collab, str(active.schema.stage)
    f.gauge("server_stage", "the stage this peer serves", active.schema.stage)
    f.gauge("server_throughput_samples_per_second", "samples/s this peer can sustain (measured)", w.throughput)
    f.gauge("server_demand_samples_per_second", "samples/s sent to it (last load snapshot)", server.load.demand)
    f.gauge("server_queue_length", "requests waiting or running on the compute thread", w.queue_length)
    f.gauge("server_epoch", "global batches this peer has finished", w.epoch, stage=stage)
    f.gauge("server_param_version", "optimizer steps behind its parameters", w.param_version, stage=stage)
    f.counter("server_samples", "samples this peer computed (forward and backward)", w.samples_processed)
    f.counter("server_microbatches", "microbatches this peer computed", w.microbatches_processed)
    f.counter("server_gradients_rejected", "microbatches whose gradients were refused", w.guard.rejected)
    f.counter(
        "server_step_samples", "samples behind the gradients this peer took for its steps", w.accumulated.step_samples
    )
    f.gauge(
        "server_largest_step_samples",
        "the most samples behind one step's gradients here",
        w.accumulated.largest_step_samples,
    )
    f.counter("server_steps_skipped", "averaged gradients that were not finite: no step", w.steps_skipped)
    f.counter("server_steps_rolled_back", "steps that left a parameter non-finite: undone", w.steps_rolled_back)
    f.counter("server_allreduce_rounds", "the stage's all-reduce rounds", collab.rounds_ok, result="ok")
    f.counter("server_allreduce_rounds", "the stage's all-reduce rounds", collab.rounds_failed, result="failed")
    if (tied := getattr(collab, "tied", None)) is not None:  # stage 0 and the last stage of tied embeddings
        for result, n in (("ok", tied.rounds_ok), ("failed", tied.rounds_failed), ("skipped", tied.rounds_skipped)):
            f.counter("server_tied_rounds", "the tied weight's rounds over both stages", n, result=result)
    f.counter("server_state_downloads", "stage states loaded from peers (joining, catching up)", collab.state_downloads)
    f.counter("server_progress_bytes", "bytes of Progress messages sent to stage peers", collab.progress_bytes)
    sent, taken = collab.progress_calls
    f.counter("server_progress_calls", "Progress calls made to stage peers", sent)
    f.counter("server_progress_messages_taken", "Progress messages taken from stage peers, relayed ones too", taken)
    f.traffic(
        "server_allreduce",
        "the stage averaging's bytes sent and received",
        {"allreduce_gradients": (collab.allreduce_bytes, collab.allreduce_fp32_bytes)},
    )
    if endpoint is None:
        return
    service = endpoint.service
    f.counter(
        "server_requests_rejected", "stage calls refused as malformed or out of bounds", service.requests_rejected
    )
    f.counter("server_requests_busy", "stage calls turned away: too many calls or bytes held", service.requests_busy)
    f.gauge("server_active_calls", "stage calls between arrival and reply", service.active_calls)
    f.traffic("server_pipeline", "stage calls' tensors received and sent", service.traffic.by_role())
    if (loss := service.recent_loss) is not None:
        f.gauge("server_loss", "last stage: mean loss of its recent backwards", loss)
