"""Runs a notebook's cells for ``POST /run_jupyter``, inside an fn pool member of the python template
(Python 3's standard library only: the template has no Jupyter kernel).

    python3 jupyter_driver.py IN.json OUT.json

IN: ``{"cells": [...], "cell_timeout": seconds (0: none)}``. The cells run one after the other in one
namespace, as in a kernel: a cell whose last statement is an expression shows its value (an
``execute_result``, ``{"text/plain": repr}``), output is caught at the file descriptors (so a child
process's output lands in its cell too), and a cell that raises records the error and the next cell
runs. OUT: ``{"status": "Finished", "cells": [{stdout, stderr, display, error}]}`` in SandboxFusion's
shape (an error is ``{ename, evalue, traceback}``, as a kernel reports it).
"""

import ast
import json
import os
import signal
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


def main(argv):
    with open(argv[1]) as f:
        cfg = json.load(f)
    signal.signal(signal.SIGALRM, _alarm)
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    cells = [cell(src, i + 1, ns, float(cfg.get("cell_timeout") or 0)) for i, src in enumerate(cfg["cells"])]
    with open(argv[2], "w") as f:
        json.dump({"status": "Finished", "cells": cells}, f)


if __name__ == "__main__":
    main(sys.argv)
