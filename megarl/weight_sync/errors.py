"""The one error a weight sync raises when it did not complete.

A ``SyncError`` means the rollout side does not hold the trainer's newest weights: the receiver
keeps its previous version number and reports itself stale, so the fleet refuses to serve
rather than generate with a half-updated model. The message names what failed (route, bucket,
peer ranks, missing tensors) so the cause can be found from the log alone.
"""
from __future__ import annotations


class SyncError(RuntimeError):
    """A weight sync failed or timed out; the rollout weights are stale until the next good sync."""
