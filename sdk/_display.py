"""A sandbox's screen (``backend="vm"``): ``sb.screenshot()`` and ``sb.input`` (keyboard and mouse),
on the ``display`` op; a sandbox without a screen answers ``NotSupported``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bus.messages import DisplayRequest, Done, MouseButton, Screenshot

if TYPE_CHECKING:
    from ._async import AsyncSandbox

DISPLAY_TIMEOUT_S = 60.0  # typing a long text goes at a typist's pace (the emulated keyboard's queue is small)


async def screenshot(sb: "AsyncSandbox") -> bytes:
    shot: Screenshot = await sb._request("display", DisplayRequest(action="screenshot"), Screenshot, timeout=DISPLAY_TIMEOUT_S)
    return shot.png


class AsyncInput:
    """Keyboard and mouse of a sandbox's screen."""

    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def _send(self, **kw: Any) -> None:
        await self._sb._request("display", DisplayRequest(**kw), Done, timeout=DISPLAY_TIMEOUT_S)

    async def type(self, text: str) -> None:
        """Type ``text`` (printable ASCII, newlines and tabs) as keystrokes."""
        await self._send(action="type", text=text)

    async def key(self, name: str) -> None:
        """Press a key by name, modifiers joined with ``+`` (``"enter"``, ``"ctrl+c"``, ``"f2"``)."""
        await self._send(action="key", key=name)

    async def click(self, x: int, y: int, button: MouseButton = "left") -> None:
        """Click at (``x``, ``y``), in the pixels of ``screenshot()``."""
        await self._send(action="click", x=x, y=y, button=button)


__all__ = ["AsyncInput", "screenshot"]
