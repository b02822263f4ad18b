"""Rollouts that outlive the trainer: jobs on a work queue (DSEC_ROLLOUTS), agent loops run by
rollout workers (``python -m sdk.rollouts``, started by ``dsec up``), state in KV ``dsec_rollouts``,
every sandbox step in the trajectory log."""

from ._client import AsyncRollouts, RolloutResult, Rollouts
from ._worker import RolloutWorker

__all__ = ["AsyncRollouts", "Rollouts", "RolloutResult", "RolloutWorker"]
