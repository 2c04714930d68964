"""Measuring one replica on this hardware: the calibration the fleet simulator runs on."""

from services.planner.replica_profile import (
    DecodeModel,
    PrefillModel,
    ProfileError,
    ReplicaProfile,
    TransferModel,
    load_profile,
)

__all__ = [
    "DecodeModel",
    "PrefillModel",
    "ProfileError",
    "ReplicaProfile",
    "TransferModel",
    "load_profile",
]
