"""Training semantics of a stage: when to step, with whom to average, how a joiner or a peer that fell behind catches up."""

from server.collab.stage import ALLREDUCE_COMPRESSION, BYTES_PER_VALUE, LocalSteps, StageAverager, StageCollaboration

__all__ = ["ALLREDUCE_COMPRESSION", "BYTES_PER_VALUE", "LocalSteps", "StageAverager", "StageCollaboration"]
