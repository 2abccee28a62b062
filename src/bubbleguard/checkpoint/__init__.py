"""Checkpoint engine: state (what), layout and planner (when), tiers (where), manifest (is it complete?).

Import the pieces from their modules (``bubbleguard.checkpoint.state``, ``...tiers.shm``, ...);
the names below are the ones the runtime uses most.
"""

from bubbleguard.checkpoint.errors import (
    CheckpointError,
    CorruptSnapshotError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from bubbleguard.checkpoint.layout import ChunkLayout
from bubbleguard.checkpoint.planner import CheckpointPlan, IdleWindow, plan_checkpoint
from bubbleguard.checkpoint.state import StageState, capture_state, restore_state, stage_selector

__all__ = [
    "CheckpointError",
    "CheckpointPlan",
    "ChunkLayout",
    "CorruptSnapshotError",
    "IdleWindow",
    "IncompleteCheckpointError",
    "StageState",
    "StateMismatchError",
    "capture_state",
    "plan_checkpoint",
    "restore_state",
    "stage_selector",
]
