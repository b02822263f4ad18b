"""The ``sim`` backend (``SimBackend``), and many simulated hosts in one process (``hosts``)."""

from __future__ import annotations

import os

from ..._backend import Backend
from ..._config import HostAgentConfig
from .backend import SimBackend


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


def from_config(config: HostAgentConfig) -> Backend:  # (mypy checks it implements the protocol)
    """A simulated host's size from the environment: ``DSEC_SIM_CPU``, ``DSEC_SIM_MEM_MB``,
    ``DSEC_SIM_DISK_MB``, ``DSEC_SIM_RESIDENT`` (share of requested memory a sandbox really holds),
    ``DSEC_SIM_CREATE_S`` (a create takes up to this long: tests that kill a host mid-batch)."""
    return SimBackend(
        cpu_total=_env_float("DSEC_SIM_CPU", 64.0),
        mem_total_mb=int(_env_float("DSEC_SIM_MEM_MB", 1024 * 1024)),
        disk_total_mb=int(_env_float("DSEC_SIM_DISK_MB", 16 * 1024 * 1024)),
        resident_fraction=_env_float("DSEC_SIM_RESIDENT", 0.25),
        create_s=_env_float("DSEC_SIM_CREATE_S", 0.0),
    )


__all__ = ["SimBackend", "from_config"]
