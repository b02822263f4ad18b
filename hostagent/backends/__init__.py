"""Sandbox backends, one package each, registered here by name. A backend's package is imported only
when a host runs it (the container backend pulls in gRPC; a sim host needs none of it); adding one is
a package and a line here, touching no other backend."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from bus.errors import UnsupportedBackend

from .._backend import Backend
from .._config import HostAgentConfig

Factory = Callable[[HostAgentConfig], Backend]

# name -> module whose ``from_config(config)`` makes the backend
REGISTRY: dict[str, str] = {
    "container": "hostagent.backends.container",
    "sim": "hostagent.backends.sim",
    "microvm": "hostagent.backends.microvm",
    "vm": "hostagent.backends.vm",
}


def names() -> list[str]:
    return list(REGISTRY)


def factory(name: str) -> Factory:
    module = REGISTRY.get(name)
    if module is None:
        raise UnsupportedBackend(f"no backend {name!r} in this host agent; it has {', '.join(REGISTRY)}", backend=name, available=",".join(REGISTRY))
    make: Factory = importlib.import_module(module).from_config
    return make


def make(config: HostAgentConfig) -> Backend:
    return factory(config.backend)(config)


__all__ = ["REGISTRY", "Factory", "factory", "make", "names"]
