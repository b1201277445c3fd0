"""Training semantics of a stage: the protocol a server drives (base), progress between peers (progress), the epoch
protocol (epoch) with its rules (rules) and its step (stepper), stage 0's admissions (gate), averaging on hivemind
(averaging), state transfers (recovery), and the private hivemind APIs they need (compat)."""

from server.collab.base import Collaboration, SoloSteps
from server.collab.epoch import Behind, Phase, StageCollaboration
from server.collab.gate import AdmissionRefused
from server.collab.intake import ProgressRefused

__all__ = [
    "AdmissionRefused",
    "Behind",
    "Collaboration",
    "SoloSteps",
    "Phase",
    "ProgressRefused",
    "StageCollaboration",
]
