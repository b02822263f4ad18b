"""The ``display`` op: screenshots and keyboard and mouse input for a sandbox with a screen (the
``Display`` ability, the full-VM backend's); any other backend answers ``not_supported``."""

from __future__ import annotations

from bus.errors import InvalidArgument
from bus.messages import DisplayRequest, Done, Screenshot

from ._backend import Capabilities, Handle


async def display(caps: Capabilities, handle: Handle, req: DisplayRequest) -> Screenshot | Done:
    screen = caps.need_display()
    match req.action:
        case "screenshot":
            return Screenshot(png=await screen.screenshot(handle))
        case "type":
            if not req.text:
                raise InvalidArgument("type needs text")
            await screen.input_type(handle, req.text)
        case "key":
            await screen.input_key(handle, req.key)
        case "click":
            await screen.input_click(handle, req.x, req.y, req.button)
    return Done()


__all__ = ["display"]
