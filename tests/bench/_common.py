"""What the bench scripts share: stopping their stack and saying what it left behind."""

from __future__ import annotations

import shutil
from typing import Any


async def stop_stack(stack: Any) -> None:
    """Stop a ``bench_sandboxes.Stack``, printing whatever it left behind (mounts, processes)."""
    left = await stack.stop()
    if left:
        print(f"LEFT BEHIND: {left}")


async def stop_lazy_stack(st: Any, lazy: Any) -> None:
    """Stop a stack that runs a lazy loader (``tests.imaged.conftest.LazyDaemon``) too; its data dir
    is removed only when no mount under it is left (else it is named)."""
    await st.stop()
    lazy.release()  # after the host agent: its layer mounts are gone, the loader's mount can go
    with open("/proc/self/mountinfo") as f:
        left = [ln.split()[4] for ln in f if str(st.dir) in ln]
    if left:
        print(f"left behind: {left}")
    else:
        shutil.rmtree(st.dir, ignore_errors=True)
