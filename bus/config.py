"""A service's settings: one frozen dataclass, built once from its flags and environment.

Each field marked with ``setting(...)`` is a command-line flag (``--field-name`` unless ``flag``
names it): its default is the dataclass field's, the only one there is, and ``--help`` shows it. A
flag not given is taken from the environment variable ``env`` when that is set, else the default.
Fields without ``setting`` are not flags: programs (tests, tools) set them, the default stands in
``python -m <service>``. Services take the config whole (``config=``) or single fields as keywords.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

C = TypeVar("C")

_KEY = "dsec_setting"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def setting(help: str, *, flag: str = "", env: str = "", default_text: str = "") -> dict[str, Any]:
    """Field metadata: ``field(default=..., metadata=setting("what it does", env="DSEC_..."))``.
    ``default_text`` shows the default in words when the value itself would mislead (None, "")."""
    return {_KEY: {"help": help, "flag": flag, "env": env, "default_text": default_text}}


# The settings every service has, worded once.
NATS_URL = setting("the NATS server(s) to connect to", default_text="$DSEC_NATS_URL, else the context `dsec up` wrote, else nats://127.0.0.1:4222")
METRICS_PORT = setting(
    "also serve Prometheus metrics over HTTP on this port, on $DSEC_METRICS_HOST or 127.0.0.1 (0: any free port); "
    "always on the bus at dsec.metrics.<service>.<instance>", env="DSEC_METRICS_PORT", default_text="none",
)


def _scalar(tp: Any) -> tuple[type, tuple[str, ...] | None]:
    """The flag's value type, and its choices for a Literal (``X | None`` is X: not given)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"a setting has one type (or it and None), not {tp}")
        tp = args[0]
    if typing.get_origin(tp) is Literal:
        return str, tuple(str(a) for a in typing.get_args(tp))
    if tp in (bool, int, float, str):
        return tp, None
    raise TypeError(f"a setting is a bool, int, float, str or Literal, not {tp}")


def _settings(cls: type) -> list[tuple[dataclasses.Field[Any], dict[str, str], type, tuple[str, ...] | None]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is not None:
            out.append((f, meta, *_scalar(hints[f.name])))
    return out


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_flags(ap: argparse.ArgumentParser, cls: type) -> None:
    """One flag per setting of ``cls``; argparse leaves a flag not given as None (see ``from_args``)."""
    for f, meta, tp, choices in _settings(cls):
        name = meta["flag"] or "--" + f.name.replace("_", "-")
        metavar = name.lstrip("-").replace("-", "_").upper()
        shown = meta["default_text"] or str(_default(f))
        env = f"; ${meta['env']} when set" if meta["env"] else ""
        help_text = f"{meta['help']} (default: {shown}{env})".replace("%", "%%")
        if tp is bool:
            ap.add_argument(name, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            ap.add_argument(name, dest=f.name, type=tp, choices=choices, default=None, metavar=metavar if choices is None else None, help=help_text)


def _parse(text: str, tp: type, choices: tuple[str, ...] | None, where: str) -> Any:
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ValueError(f"{where}: {text!r} is not a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")
    try:
        v = tp(text)
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a valid {tp.__name__}") from None
    if choices is not None and v not in choices:
        raise ValueError(f"{where}: {text!r} is not one of {', '.join(choices)}")
    return v


def from_args(cls: type[C], args: argparse.Namespace, env: Mapping[str, str] = os.environ, **fields: Any) -> C:
    """The config: each setting from its flag, else its environment variable, else its default;
    ``fields`` set the others (or override)."""
    kw: dict[str, Any] = {}
    for f, meta, tp, choices in _settings(cls):
        v = getattr(args, f.name, None)
        if v is None and meta["env"] and env.get(meta["env"]):
            v = _parse(env[meta["env"]], tp, choices, f"${meta['env']}")
        if v is not None:
            kw[f.name] = v
    kw.update(fields)
    return cls(**kw)


def parser(prog: str, description: str | None, cls: type) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(ap, cls)
    return ap


__all__ = ["METRICS_PORT", "NATS_URL", "add_flags", "from_args", "parser", "setting"]
