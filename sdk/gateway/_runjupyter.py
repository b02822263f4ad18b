"""``POST /run_jupyter``: SandboxFusion's notebook call over FnCall (``sandbox_fusion.run_jupyter``).

Request: ``cells`` (code strings), ``cell_timeout`` (0: none), ``total_timeout``, ``kernel``
(``python3``), ``files`` (path -> base64), ``fetch_files``. Answer: ``status`` (Success once the cells
ran, errors in them included; Failed when the notebook ran past ``total_timeout``; SandboxError for
bad input), ``message``, ``driver`` (the run of the notebook as a whole, as ``run_result`` of
``/run_code``), ``cells`` (per cell ``stdout``, ``stderr``, ``display``: the values shown,
``{"text/plain": repr}``, ``error``: ``{ename, evalue, traceback}``), ``files`` (base64).

The cells run in one call on a member of the python template (``jupyter_driver``): on a real IPython
kernel started for the call where the template has ipykernel and jupyter_client, else in one Python
process, one namespace, the cells in order, as a kernel runs them. The key rides in the URL as for
``/run_code``.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from bus.errors import DsecError, InvalidArgument
from bus.messages import FnCallRequest, FnFile

from .._fncall import AsyncFnCall, language
from ._runcode import QUEUE_S, command, fetch_of, files_of, number, read_call, sandbox_error

DRIVER = Path(__file__).with_name("jupyter_driver.py").read_text()
_IN, _OUT, _PY = ".dsec-jupyter-in.json", ".dsec-jupyter-out.json", ".dsec-jupyter.py"
KERNELS = {"python3": "python"}  # kernel -> the language (and so the template) that runs its cells
START_S = 10.0  # the driver's own start and the answer's writing, beyond total_timeout


class RunJupyter:
    def __init__(self, gw: Any) -> None:
        self.gw = gw

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/run_jupyter", self.run_jupyter)
        app.router.add_post("/k/{key}/run_jupyter", self.run_jupyter)

    async def run_jupyter(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(await self._run(request))
        except DsecError as exc:
            return sandbox_error(exc.http_status, exc.code, exc.description, driver=None, cells=[])

    async def _run(self, request: web.Request) -> dict[str, Any]:
        tenant, body = await read_call(self.gw, request)
        cells = body.get("cells")
        if not isinstance(cells, list) or not all(isinstance(c, str) for c in cells):
            raise InvalidArgument("cells must be a list of code strings")
        kernel = body.get("kernel") or "python3"
        if kernel not in KERNELS:
            raise InvalidArgument(f"unknown kernel {kernel!r}; one of {', '.join(KERNELS)}")
        cell_timeout, total = number(body, "cell_timeout", 0.0), number(body, "total_timeout", 45.0)
        files = files_of(body.get("files"))
        fetch = fetch_of(body)
        for name in (_IN, _OUT, _PY):
            if name in files:
                raise InvalidArgument(f"{name} is the notebook driver's own file")
        files[_PY] = DRIVER.encode()
        files[_IN] = json.dumps({"cells": cells, "cell_timeout": cell_timeout}).encode()
        req = FnCallRequest(
            cmd=f"python3 {_PY} {_IN} {_OUT}", files=[FnFile(path=p, data=d) for p, d in files.items()], timeout_s=total + START_S,
            fetch_files=[*fetch, _OUT], queue_s=QUEUE_S,
            trusted=True,  # as /run_code: a grader's run (no agent-planted startup files)
        )
        out = await AsyncFnCall(nc=tenant.nc, queue_timeout=QUEUE_S).call(language(KERNELS[kernel]).template, req)
        result = out.files.pop(_OUT, None)
        answer: dict[str, Any] = {
            "status": "Failed", "message": "", "driver": command(out.run, out.oom), "cells": [], "executor_pod_name": out.host_id,
            "files": {p: base64.b64encode(d).decode() for p, d in out.files.items()},
        }
        if out.oom:
            answer["message"] = "out of memory: the notebook went past its memory limit"
        elif out.run is not None and out.run.timed_out:
            answer["message"] = f"the notebook ran past its total_timeout ({total:g}s)"
        elif result is None:
            answer["message"] = "the notebook driver ended without an answer"
        else:
            answer["status"], answer["cells"] = "Success", json.loads(result)["cells"]
        return answer


__all__ = ["RunJupyter"]
