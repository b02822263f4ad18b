"""FnCall: stateless calls served from the hosts' warm pools (``dsec up --fn-pool base=8,python=8``).

Each call is one core request on ``dsec.fn.<tenant>.<template>.call`` (the connection's tenant:
its credential may publish under no other); every host keeping a pool of the template takes it in
one queue group, so the call goes straight to a host with members, with no sandbox created on the
way, and serves a tenant's private template to that tenant and the operator only. Each call starts from its template's state: between calls the host
resets the member (or replaces it), so nothing a call leaves (files, processes, shared memory,
environment) is seen by another.

Languages of ``run_code`` and the templates that serve them (``LANGUAGES``; ``templates=`` changes them):

- ``python`` (``python3``): template ``python`` (``dsec image build-python``)
- ``bash``: template ``python`` (Debian's bash)
- ``sh``: template ``base`` (busybox)
- ``cpp`` (``c++``): template ``cpp`` (a Debian template with g++; see tests/integration/test_fncall.py)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from bus import codec
from bus import subjects as S
from bus.codec import decode_reply
from bus.errors import InvalidArgument, SandboxTimeout, UnknownTemplate
from bus.fncall import check_call
from bus.messages import ExecResult, FnCallRequest, FnCallResult, FnFile
from bus.runtime import tenant_of

from ._async import _nc
from ._commands import _result
from ._models import CommandResult
from ._requests import requests_for
from ._sync import _run

# Beyond the call's own timeouts: writing its files, waiting for a started interpreter to load and
# killing it at the timeout (hostagent._fnzygote: 20 s at most), fetching files, the reply.
REPLY_MARGIN_S = 30.0


@dataclass(frozen=True)
class Language:
    template: str
    source: str  # the file the code is written to, in the working directory
    run: str
    compile: str = ""


LANGUAGES: dict[str, Language] = {
    "python": Language("python", "main.py", "python3 main.py"),
    "bash": Language("python", "main.sh", "bash main.sh"),
    "sh": Language("base", "main.sh", "sh main.sh"),
    "cpp": Language("cpp", "main.cpp", "./main", "g++ -O2 -std=c++17 -o main main.cpp"),
}
ALIASES = {"python3": "python", "c++": "cpp", "shell": "sh"}


def language(name: str, templates: Mapping[str, str] | None = None) -> Language:
    """The language ``name`` (or an alias), with its template as ``templates`` overrides it."""
    key = ALIASES.get(name, name)
    lang = LANGUAGES.get(key)
    if lang is None:
        raise InvalidArgument(f"unknown language {name!r}; one of {', '.join(sorted(LANGUAGES))}", language=name)
    if templates and key in templates:
        return Language(templates[key], lang.source, lang.run, lang.compile)
    return lang


def _files(files: Mapping[str, str | bytes] | None) -> list[FnFile]:
    return [FnFile(path=p, data=d.encode() if isinstance(d, str) else bytes(d)) for p, d in (files or {}).items()]


def command_result(res: ExecResult | None, oom: bool = False) -> CommandResult:
    """What ``run`` returns: the run's result, its ``error`` saying why it ended early (timeout, memory)."""
    if res is None:
        return CommandResult(stdout="", stderr="", exit_code=-1, error="nothing ran")
    error = None
    if res.timed_out:
        error = "command timed out and was killed"
    elif oom:
        error = "out of memory: the call's memory limit was hit"
    return _result(res, res.stdout, res.stderr, error)


class AsyncFnCall:
    """Stateless calls (``await AsyncFnCall().run("echo hi")``). ``queue_timeout``: how long a call may
    wait for a free pool member before ``NoCapacity``."""

    def __init__(
        self, *, nats_url: str | None = None, nc: NATS | None = None, queue_timeout: float = 10.0, templates: Mapping[str, str] | None = None,
    ) -> None:
        self.nats_url = nats_url
        self._nc = nc
        self.queue_timeout = queue_timeout
        self.templates = dict(templates or {})

    async def _conn(self) -> NATS:
        if self._nc is None or self._nc.is_closed:
            self._nc = await _nc(self.nats_url)
        return self._nc

    async def call(self, template: str, req: FnCallRequest) -> FnCallResult:
        """One call as the wire has it (every option of ``FnCallRequest``)."""
        if not S.valid_token(template):
            raise InvalidArgument(f"not a template name: {template!r}")
        check_call(req)
        nc = await self._conn()
        wait = req.queue_s + req.timeout_s + (req.compile_timeout_s if req.compile_cmd else 0.0) + REPLY_MARGIN_S
        try:
            msg = await (await requests_for(nc)).request(S.fn_call(template, tenant_of(nc)), codec.encode(req), wait)
        except nats.errors.NoRespondersError:
            raise UnknownTemplate(f"no host keeps an fn pool of template {template!r} (dsec up --fn-pool {template}=N)", template=template) from None
        except nats.errors.TimeoutError:
            raise SandboxTimeout(f"the fn call on {template!r} was not answered within {wait:g}s") from None
        except nats.errors.MaxPayloadError:
            raise InvalidArgument(f"the call is larger than the NATS server's max_payload ({nc.max_payload} bytes)") from None
        out: FnCallResult = decode_reply(msg.data, FnCallResult)
        return out

    async def run(
        self, cmd: str, template: str = "base", files: Mapping[str, str | bytes] | None = None, envs: dict[str, str] | None = None,
        timeout: float = 30, *, memory_mb: int = 0, stdin: str | bytes = b"", fetch_files: list[str] | None = None,
    ) -> CommandResult:
        """Run ``cmd`` (``sh -c``) in a fresh member of ``template``'s pool, ``files`` written into its
        working directory first. A non-zero exit is a result, not an error."""
        out = await self.call(template, self._request(cmd, files, envs, timeout, memory_mb, stdin, fetch_files))
        return command_result(out.run, out.oom)

    async def run_code(
        self, code: str, language: str = "python", files: Mapping[str, str | bytes] | None = None, envs: dict[str, str] | None = None,
        timeout: float = 30, *, compile_timeout: float = 10.0, memory_mb: int = 0, stdin: str | bytes = b"",
        fetch_files: list[str] | None = None,
    ) -> CommandResult:
        """Run ``code`` in ``language`` (``LANGUAGES``); a compile error comes back as the result."""
        template, req = self.code_request(code, language, files, envs, timeout, compile_timeout=compile_timeout,
                                          memory_mb=memory_mb, stdin=stdin, fetch_files=fetch_files)
        out = await self.call(template, req)
        if out.run is None and out.compile is not None:
            return command_result(out.compile, out.oom)
        return command_result(out.run, out.oom)

    def code_request(
        self, code: str, language_name: str, files: Mapping[str, str | bytes] | None, envs: dict[str, str] | None, timeout: float, *,
        compile_timeout: float = 10.0, memory_mb: int = 0, stdin: str | bytes = b"", fetch_files: list[str] | None = None,
    ) -> tuple[str, FnCallRequest]:
        """The template and request that run ``code`` in ``language_name`` (the gateway's ``/run_code`` too)."""
        lang = language(language_name, self.templates)
        req = self._request(lang.run, {**(files or {}), lang.source: code}, envs, timeout, memory_mb, stdin, fetch_files)
        req.compile_cmd, req.compile_timeout_s = lang.compile, compile_timeout
        return lang.template, req

    def _request(
        self, cmd: str, files: Mapping[str, str | bytes] | None, envs: dict[str, str] | None, timeout: float, memory_mb: int,
        stdin: str | bytes, fetch_files: list[str] | None,
    ) -> FnCallRequest:
        return FnCallRequest(
            cmd=cmd, files=_files(files), envs=dict(envs or {}), timeout_s=float(timeout), memory_mb=int(memory_mb),
            stdin=stdin.encode() if isinstance(stdin, str) else bytes(stdin), fetch_files=list(fetch_files or []),
            queue_s=float(self.queue_timeout),
        )


class FnCall:
    """The synchronous ``AsyncFnCall`` (``FnCall().run("true")``)."""

    def __init__(self, **kwargs: Any) -> None:
        self._a = AsyncFnCall(**kwargs)

    def run(self, cmd: str, template: str = "base", files: Mapping[str, str | bytes] | None = None, envs: dict[str, str] | None = None,
            timeout: float = 30, **kwargs: Any) -> CommandResult:
        return _run(self._a.run(cmd, template, files, envs, timeout, **kwargs))

    def run_code(self, code: str, language: str = "python", files: Mapping[str, str | bytes] | None = None,
                 envs: dict[str, str] | None = None, timeout: float = 30, **kwargs: Any) -> CommandResult:
        return _run(self._a.run_code(code, language, files, envs, timeout, **kwargs))


__all__ = ["ALIASES", "LANGUAGES", "AsyncFnCall", "FnCall", "Language", "command_result", "language"]
