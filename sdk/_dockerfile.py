"""Dockerfiles -> build steps (``sdk._builder`` runs them): FROM, RUN, COPY, ADD, ENV, WORKDIR, USER,
ARG, CMD, ENTRYPOINT, SHELL; LABEL, EXPOSE, VOLUME, STOPSIGNAL, HEALTHCHECK and MAINTAINER are read
and kept out of the template (they describe a container engine's run, not the files). Line
continuations, comments, parser directives, JSON (exec) and shell forms, and ``$VAR`` / ``${VAR}`` /
``${VAR:-default}`` / ``${VAR:+alt}`` in the instructions Docker expands them in. One stage only.
Anything else is an ``InvalidArgument`` naming the line."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Literal

from bus.errors import InvalidArgument

StepKind = Literal["FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "ARG", "CMD", "ENTRYPOINT", "SHELL"]
IGNORED = {"LABEL", "EXPOSE", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER"}
_EXPANDS = {"FROM", "COPY", "ADD", "ENV", "WORKDIR", "USER", "ARG"}  # Docker's list (plus the ignored ones)
_VAR = re.compile(r"\\?\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


@dataclass
class Step:
    """One instruction, its arguments already expanded. ``args``: RUN/CMD/ENTRYPOINT/SHELL the command
    (a list for the exec form, one string for the shell form); COPY/ADD the sources then the
    destination; ENV/ARG ``[key, value]`` pairs flattened; FROM/WORKDIR/USER one value."""

    kind: StepKind
    args: list[str]
    exec_form: bool = False
    flags: dict[str, str] = field(default_factory=dict)
    line: int = 0

    @property
    def text(self) -> str:
        """The canonical form: the same text for the same step (the step cache keys on it)."""
        flags = "".join(f" --{k}={v}" for k, v in sorted(self.flags.items()))
        body = json.dumps(self.args) if self.exec_form or self.kind in ("COPY", "ADD", "ENV", "ARG") else " ".join(self.args)
        return f"{self.kind}{flags} {body}"


def expand(s: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("\\"):
            return m.group(0)[1:]
        name = m.group(1) or m.group(4)
        val = env.get(name)
        if m.group(2) == "-":
            return val if val else m.group(3)
        if m.group(2) == "+":
            return m.group(3) if val else ""
        return val or ""

    return _VAR.sub(sub, s)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        stripped = line.strip()
        if stripped.startswith("#"):
            continue  # comments, and parser directives (syntax=, escape=): the default escape is what is supported
        if not stripped:
            continue  # blank lines, inside a continuation too, are dropped as Docker drops them
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        out.append((start, " ".join(b.strip() for b in buf)))
        buf = []
    if buf:
        out.append((start, " ".join(b.strip() for b in buf)))
    return out


def _json_form(rest: str) -> list[str] | None:
    if not rest.startswith("["):
        return None
    try:
        v = json.loads(rest)
    except ValueError:
        return None
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return v
    return None


def _flags(rest: str, allowed: set[str], line: int, kind: str) -> tuple[dict[str, str], str]:
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        rest = rest.lstrip()
        k, _, v = word[2:].partition("=")
        if k not in allowed:
            raise InvalidArgument(f"line {line}: {kind} --{k} is not supported", line=line)
        flags[k] = v
    return flags, rest


def _pairs(rest: str, line: int, kind: str, env: dict[str, str]) -> list[str]:
    """``K=V K2="v 2"`` (or the legacy ``ENV K some value``) -> [K, V, K2, v 2]."""
    try:
        words = shlex.split(rest, posix=True)
    except ValueError as exc:
        raise InvalidArgument(f"line {line}: {kind}: {exc}", line=line) from None
    if not words:
        raise InvalidArgument(f"line {line}: {kind} needs arguments", line=line)
    if kind == "ENV" and "=" not in words[0]:
        key, _, value = rest.partition(" ")
        return [key, expand(value.strip(), env)]
    out: list[str] = []
    for w in words:
        k, eq, v = w.partition("=")
        if not re.match(r"^[A-Za-z_]\w*$", k):
            raise InvalidArgument(f"line {line}: bad {kind} name {k!r}", line=line)
        if kind == "ENV" and not eq:
            raise InvalidArgument(f"line {line}: ENV {k} has no value", line=line)
        out += [k, expand(v, env) if eq else "\0unset"]
    return out


def parse_dockerfile(text: str, build_args: dict[str, str] | None = None) -> list[Step]:
    """The steps of a one-stage Dockerfile, variables expanded as Docker expands them."""
    build_args = dict(build_args or {})
    env: dict[str, str] = {}  # what ENV and ARG define so far (for expansion)
    steps: list[Step] = []
    seen_from = False
    for line, body in _logical_lines(text):
        word, _, rest = body.partition(" ")
        kind = word.upper()
        rest = rest.strip()
        if kind in IGNORED:
            continue
        if kind not in StepKind.__args__:  # type: ignore[attr-defined]
            raise InvalidArgument(f"line {line}: unknown instruction {word!r}", line=line, instruction=word)
        if kind == "FROM":
            if seen_from:
                raise InvalidArgument(f"line {line}: multi-stage builds (a second FROM) are not supported", line=line)
            seen_from = True
        elif not seen_from and kind != "ARG":
            raise InvalidArgument(f"line {line}: {kind} before FROM", line=line)
        if not rest:
            raise InvalidArgument(f"line {line}: {kind} needs arguments", line=line)
        steps.append(_step(kind, rest, line, env, build_args))
    if not seen_from:
        raise InvalidArgument("the Dockerfile has no FROM")
    return steps


def _step(kind: str, rest: str, line: int, env: dict[str, str], build_args: dict[str, str]) -> Step:
    if kind in ("RUN", "CMD", "ENTRYPOINT", "SHELL"):
        flags, rest = _flags(rest, {"network"} if kind == "RUN" else set(), line, kind)
        form = _json_form(rest)
        if kind == "SHELL" and form is None:
            raise InvalidArgument(f"line {line}: SHELL takes the JSON form", line=line)
        return Step(kind, form if form is not None else [rest], exec_form=form is not None, flags=flags, line=line)  # type: ignore[arg-type]
    if kind in ("COPY", "ADD"):
        flags, rest = _flags(rest, {"chown", "chmod", "link", "from"}, line, kind)
        if "from" in flags:
            raise InvalidArgument(f"line {line}: {kind} --from (another stage or image) is not supported", line=line)
        flags.pop("link", None)
        form = _json_form(rest)
        try:
            words = form if form is not None else shlex.split(rest)
        except ValueError as exc:
            raise InvalidArgument(f"line {line}: {kind}: {exc}", line=line) from None
        words = [expand(w, env) for w in words]
        if len(words) < 2:
            raise InvalidArgument(f"line {line}: {kind} needs a source and a destination", line=line)
        return Step(kind, words, flags={k: expand(v, env) for k, v in flags.items()}, line=line)  # type: ignore[arg-type]
    if kind in ("ENV", "ARG"):
        pairs = _pairs(rest, line, kind, env)
        for i in range(0, len(pairs), 2):
            k, v = pairs[i], pairs[i + 1]
            if kind == "ARG":
                v = build_args.get(k, "" if v == "\0unset" else v)
                pairs[i + 1] = v
            env[k] = v
        return Step(kind, pairs, line=line)  # type: ignore[arg-type]
    flags = {}
    if kind == "FROM":
        flags, rest = _flags(rest, {"platform"}, line, kind)
        rest = rest.split()[0]  # FROM image [AS name]: one stage, so the name is not needed
    value = expand(rest, env)
    if not value:
        raise InvalidArgument(f"line {line}: {kind} is empty after expansion", line=line)
    return Step(kind, [value], flags={k: expand(v, env) for k, v in flags.items()}, line=line)  # type: ignore[arg-type]
