"""The host agent: one per host; runs sandboxes through a backend and serves their operations."""

from ._backend import Backend, Handle, SimBackend, Usage
from ._service import HostAgent

__all__ = ["HostAgent", "Backend", "Handle", "SimBackend", "Usage"]
