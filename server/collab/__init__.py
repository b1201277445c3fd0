"""Training semantics of a stage: the protocol a server drives (base), progress between peers (progress), the epoch
protocol (epoch), averaging on hivemind (averaging), state transfers (recovery), and the private hivemind APIs they
need (compat)."""

from server.collab.base import Collaboration, LocalSteps
from server.collab.epoch import AdmissionRefused, Behind, Phase, ProgressRefused, StageCollaboration

__all__ = [
    "AdmissionRefused",
    "Behind",
    "Collaboration",
    "LocalSteps",
    "Phase",
    "ProgressRefused",
    "StageCollaboration",
]
