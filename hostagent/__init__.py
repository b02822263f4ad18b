"""The host agent: one per host; runs sandboxes through a backend and serves their operations."""

from ._backend import Backend, Capabilities, Handle, HostCapacity, Usage
from ._config import HostAgentConfig
from ._service import HostAgent
from .backends.sim import SimBackend

__all__ = ["Backend", "Capabilities", "Handle", "HostAgent", "HostAgentConfig", "HostCapacity", "SimBackend", "Usage"]
