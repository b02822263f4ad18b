"""Runs a notebook's cells for ``POST /run_jupyter``, inside an fn pool member of the python template.

    python3 jupyter_driver.py IN.json OUT.json

IN: ``{"cells": [...], "cell_timeout": seconds (0: none)}``. OUT: ``{"status": "Finished", "kernel":
"ipykernel" | "inline", "cells": [{stdout, stderr, display, error}]}`` in SandboxFusion's shape
(``display``: the data of each ``execute_result`` and ``display_data``; an error is ``{ename,
evalue, traceback}``, as a kernel reports it).

Where the template has ``jupyter_client`` and ``ipykernel`` (Debian's ``python3-jupyter-client``
and ``python3-ipykernel``), the cells run on a real IPython kernel started for this call (over
unix sockets in a private directory: the member has no network), one after the other; a cell past
``cell_timeout`` is interrupted (its error is a ``TimeoutError``) and the next one runs. Elsewhere
(Python 3's standard library only) they run inline, one namespace, as a kernel runs them: a cell
whose last statement is an expression shows its value (``{"text/plain": repr}``), output is caught
at the file descriptors (so a child process's output lands in its cell too), and a cell that raises
records the error and the next cell runs.
"""

import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback


class CellTimeout(BaseException):
    """Raised in a cell at its timeout (a BaseException: the cell's own ``except Exception`` passes it on)."""


def _alarm(signum, frame):
    raise CellTimeout()


def _run(src, name, ns, timeout):
    tree = ast.parse(src, name)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if timeout > 0:
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(compile(tree, name, "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), ns)
            if value is not None:
                return [{"text/plain": repr(value)}]
        return []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def cell(src, index, ns, timeout):
    out: dict = {"stdout": "", "stderr": "", "display": [], "error": []}
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(fo.fileno(), 1)
        os.dup2(fe.fileno(), 2)
        try:
            out["display"] = _run(src, f"<cell {index}>", ns, timeout)
        except CellTimeout:
            out["error"].append({"ename": "TimeoutError", "evalue": f"the cell ran past its timeout of {timeout:g}s", "traceback": []})
        except BaseException as exc:  # noqa: BLE001 - a cell's error (SystemExit too) is its result
            tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
            out["error"].append({"ename": type(exc).__name__, "evalue": str(exc), "traceback": tb})
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        for key, f in (("stdout", fo), ("stderr", fe)):
            f.seek(0)
            out[key] = f.read().decode("utf-8", "replace")
    return out


def inline(cfg):
    signal.signal(signal.SIGALRM, _alarm)
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    return [cell(src, i + 1, ns, float(cfg.get("cell_timeout") or 0)) for i, src in enumerate(cfg["cells"])]


def _kernel_cell(km, kc, src, timeout):
    import queue
    import time

    out: dict = {"stdout": "", "stderr": "", "display": [], "error": []}
    msg_id = kc.execute(src, allow_stdin=False)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    interrupted = False
    while True:
        wait = 3600.0 if deadline is None else max(0.05, deadline - time.monotonic())
        try:
            msg = kc.get_iopub_msg(timeout=wait)
        except queue.Empty:
            if deadline is not None and time.monotonic() >= deadline and not interrupted:
                km.interrupt_kernel()
                out["error"].append({"ename": "TimeoutError", "evalue": f"the cell ran past its timeout of {timeout:g}s", "traceback": []})
                interrupted, deadline = True, time.monotonic() + 30  # (the interrupt's own answer)
                continue
            raise RuntimeError("the kernel stopped answering") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content.get("name") in ("stdout", "stderr"):
            out[content["name"]] += content["text"]
        elif kind in ("execute_result", "display_data"):
            out["display"].append(content["data"])
        elif kind == "error" and not interrupted:
            out["error"].append({"ename": content["ename"], "evalue": content["evalue"], "traceback": content["traceback"]})
        elif kind == "status" and content.get("execution_state") == "idle":
            return out


def kernel(cfg):
    from jupyter_client.manager import KernelManager

    timeout = float(cfg.get("cell_timeout") or 0)
    with tempfile.TemporaryDirectory() as d:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(d, "kernel"),
                           connection_file=os.path.join(d, "kernel.json"))
        # (the kernel's own output is its business: what a cell prints reaches the cell over the kernel's channels)
        km.start_kernel(cwd=os.getcwd(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kc = km.client()
        try:
            kc.start_channels()
            kc.wait_for_ready(timeout=60)
            return [_kernel_cell(km, kc, src, timeout) for src in cfg["cells"]]
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)


def main(argv):
    with open(argv[1]) as f:
        cfg = json.load(f)
    try:
        import ipykernel  # noqa: F401 - only whether the template has them
        import jupyter_client  # noqa: F401
    except ImportError:
        kind, cells = "inline", inline(cfg)
    else:
        kind, cells = "ipykernel", kernel(cfg)
    with open(argv[2], "w") as f:
        json.dump({"status": "Finished", "kernel": kind, "cells": cells}, f)


if __name__ == "__main__":
    main(sys.argv)
