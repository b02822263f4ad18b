"""Placement: chooses a host for every create request; replicas share one durable consumer."""

from ._config import PlacementConfig
from ._service import Placement
from ._table import HostTable, Policy

__all__ = ["Placement", "PlacementConfig", "HostTable", "Policy"]
