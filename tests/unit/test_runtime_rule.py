"""The rule of the runtime layer: only bus/ touches nats-py mechanics or ``$JS.``/``$KV.`` subjects.

Outside bus/ a module may not
* spell a ``$JS.`` or ``$KV.`` subject (any string constant, f-strings included),
* pass ``future=`` (nats-py's synchronous-delivery trick lives in bus.runtime.publisher),
* reach into a JetStream context's connection (``._nc``; a module's own ``self._nc`` is its own),
* import nats-py beyond its public types and errors (``ALLOWED_NATS_MODULES``); connecting,
  subscribing mechanics, the protocol and the JetStream client internals go through bus.runtime.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("placement", "hostagent", "imaged", "guard", "sdk")

ALLOWED_NATS_MODULES = {
    "nats.errors",  # exceptions a caller catches
    "nats.js.errors",
    "nats.js.api",  # configuration types (StorageType, DeliverPolicy, ObjectStoreConfig, ...)
    "nats.aio.msg",  # the Msg type handlers receive
    "nats.aio.client",  # the Client type, in annotations
    "nats.js",  # the JetStreamContext type
    "nats.js.kv",  # the KeyValue type (watches)
}

def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own_nc = any(
        isinstance(n, ast.Attribute) and n.attr == "_nc" and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ast.Store)
        for n in ast.walk(tree)
    )
    out: list[str] = []
    for n in ast.walk(tree):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{getattr(n, 'lineno', 0)}"
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and ("$JS." in n.value or "$KV." in n.value):
            out.append(f"{where}: JetStream/KV subject {n.value[:40]!r}")
        elif isinstance(n, ast.keyword) and n.arg == "future":
            out.append(f"{where}: future= subscription")
        elif isinstance(n, ast.Attribute) and n.attr == "_nc" and not own_nc:
            out.append(f"{where}: ._nc (a JetStream context's private connection)")
        elif isinstance(n, ast.Import):
            for a in n.names:
                if (a.name == "nats" or a.name.startswith("nats.")) and a.name not in ALLOWED_NATS_MODULES:
                    out.append(f"{where}: import {a.name}")
        elif (
            isinstance(n, ast.ImportFrom) and n.module and n.level == 0
            and (n.module == "nats" or n.module.startswith("nats.")) and n.module not in ALLOWED_NATS_MODULES
        ):
            out.append(f"{where}: from {n.module} import ...")
    return out


def _service_files() -> list[Path]:
    return sorted(p for s in SERVICES for p in (ROOT / s).rglob("*.py"))


def test_only_bus_touches_nats_mechanics() -> None:
    found = [v for p in _service_files() for v in _violations(p)]
    assert not found, "outside bus/ (use bus.runtime):\n" + "\n".join(found)


def test_the_scan_sees_each_kind(tmp_path: Path) -> None:
    """Positive control: every forbidden form is reported."""
    bad = tmp_path / "probe.py"
    bad.write_text(
        "import nats\nfrom nats.aio.subscription import Subscription\n"
        "def f(js, nc, sink, b):\n"
        "    nc.subscribe('x', future=sink)\n"
        "    return js._nc, f'$KV.{b}.k', '$JS.API.CONSUMER.MSG.NEXT.S.d'\n"
    )
    kinds = _violations(bad)
    assert len(kinds) == 6, kinds
