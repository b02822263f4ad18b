"""``VMBackend``: the microvm backend on a q35 PC with a standard VGA display, a virtio tablet for
absolute pointer events, booted with Debian's generic kernel (its bochs DRM driver gives the display
a framebuffer). On the screen: the template's desktop when it has one (``/usr/local/bin/dsec-desktop``,
as the GUI template from ``compose/gui-rootfs.sh`` does: Xorg, twm, xterm), else a shell on the first
virtual terminal. Screenshots are QMP ``screendump`` (PNG); keys and clicks are QMP ``input-send-event``."""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile
from typing import Any

from bus.errors import InvalidArgument, SandboxNotFound
from bus.messages import BackendName, ExecRequest

from ..._backend import Handle
from ..microvm import qemu
from ..microvm.backend import MicroVMBackend
from ..microvm.kernel import GENERIC_PACKAGE, GUEST_MODULES

DESKTOP = "/usr/local/bin/dsec-desktop"
# the template's desktop, else a login-less shell on tty1, its controlling terminal (what a user at
# the screen would type into)
CONSOLE_SHELL = (f"if [ -x {DESKTOP} ]; then setsid {DESKTOP} </dev/null >/dev/null 2>&1 & "
                 "else setsid -c sh -c 'exec sh -i <>/dev/tty1 >&0 2>&0' >/dev/null 2>&1 & fi")

_NAMED = {
    " ": "spc", "\n": "ret", "\t": "tab", "-": "minus", "=": "equal", ".": "dot", ",": "comma", "/": "slash",
    ";": "semicolon", "'": "apostrophe", "[": "bracket_left", "]": "bracket_right", "\\": "backslash", "`": "grave_accent",
}
_SHIFTED = {
    "_": "minus", "+": "equal", ">": "dot", "<": "comma", "?": "slash", ":": "semicolon", '"': "apostrophe", "{": "bracket_left",
    "}": "bracket_right", "|": "backslash", "~": "grave_accent", "!": "1", "@": "2", "#": "3", "$": "4", "%": "5", "^": "6",
    "&": "7", "*": "8", "(": "9", ")": "0",
}
KEYS = {"enter": "ret", "return": "ret", "escape": "esc", "esc": "esc", "backspace": "backspace", "tab": "tab", "space": "spc",
        "up": "up", "down": "down", "left": "left", "right": "right", "home": "home", "end": "end", "delete": "delete",
        **{f"f{i}": f"f{i}" for i in range(1, 13)}}
MODIFIERS = {"ctrl": "ctrl", "shift": "shift", "alt": "alt", "meta": "meta_l", "super": "meta_l"}
KEY_INTERVAL_S = 0.02  # a typist's pace the emulated keyboard's small queue keeps up with


def _qcodes(ch: str) -> list[str]:
    """The keys one character takes (shift first when it needs it)."""
    if "a" <= ch <= "z" or "0" <= ch <= "9":
        return [ch]
    if "A" <= ch <= "Z":
        return ["shift", ch.lower()]
    if ch in _NAMED:
        return [_NAMED[ch]]
    if ch in _SHIFTED:
        return ["shift", _SHIFTED[ch]]
    raise InvalidArgument(f"cannot type {ch!r} on the VM's keyboard")


def _press(codes: list[str]) -> list[dict[str, Any]]:
    def key(c: str, down: bool) -> dict[str, Any]:
        return {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": c}}}

    return [key(c, True) for c in codes] + [key(c, False) for c in reversed(codes)]


class VMBackend(MicroVMBackend):
    """Sandboxes as full VMs with a display (``backend="vm"``)."""

    name: BackendName = "vm"
    machine: qemu.Machine = "q35"
    kernel_package = GENERIC_PACKAGE
    tcg_tb_mb = 0  # QEMU's default: a desktop (Xorg, a browser) runs far more code than an idle microVM
    # the tablet and its /dev/input/event node; the display's DRM driver (a framebuffer for fbcon and Xorg)
    # (the generic kernel builds as modules what the cloud one has built in: ext4, and the crc32c EROFS asks for)
    modules = ("crc32c_generic", "ext4", *GUEST_MODULES, "virtio_pci", "virtio_input", "evdev", "bochs")

    async def _booted(self, sid: str) -> None:
        await self.exec(Handle(sid), ExecRequest(cmd=CONSOLE_SHELL), None)

    def _qmp_sock(self, handle: Handle) -> str:
        d = self._dir(handle.sandbox_id)
        if qemu.read_pid(d) is None:
            raise SandboxNotFound(f"sandbox {handle.sandbox_id} is not running on this host")
        return os.path.join(d, "qmp.sock")

    async def screenshot(self, handle: Handle) -> bytes:
        """The display as PNG."""
        sock = self._qmp_sock(handle)
        fd, path = tempfile.mkstemp(dir=self._dir(handle.sandbox_id), prefix=".shot-", suffix=".png")
        os.close(fd)
        try:
            await qemu.qmp(sock, ("screendump", {"filename": path, "format": "png"}))
            with open(path, "rb") as f:
                return f.read()
        finally:
            os.unlink(path)

    async def input_type(self, handle: Handle, text: str) -> None:
        presses = [_press(_qcodes(ch)) for ch in text]  # all checked before any is sent
        sock = self._qmp_sock(handle)
        for events in presses:
            await qemu.qmp(sock, ("input-send-event", {"events": events}))
            # The PS/2 keyboard's queue holds a few keys: QEMU drops what the guest has not read yet.
            await asyncio.sleep(KEY_INTERVAL_S)

    async def input_key(self, handle: Handle, name: str) -> None:
        """A key by name, with modifiers joined by ``+`` (``"enter"``, ``"ctrl+c"``)."""
        codes = []
        for part in name.lower().split("+"):
            code = MODIFIERS.get(part) or KEYS.get(part) or (part if len(part) == 1 and part.isalnum() else None)
            if code is None:
                raise InvalidArgument(f"unknown key {part!r} in {name!r}")
            codes.append(code)
        await qemu.qmp(self._qmp_sock(handle), ("input-send-event", {"events": _press(codes)}))

    async def screen_size(self, handle: Handle) -> tuple[int, int]:
        """The display's mode now (a text console, the desktop's: the guest sets it), from a screenshot's PNG header."""
        png = await self.screenshot(handle)
        width, height = struct.unpack(">II", png[16:24])
        return width, height

    async def input_click(self, handle: Handle, x: int, y: int, button: str = "left") -> None:
        w, h = await self.screen_size(handle)  # clicks are scaled from it to the tablet's range
        if not (0 <= x < w and 0 <= y < h):
            raise InvalidArgument(f"({x}, {y}) is off the {w}x{h} screen")
        move = [{"type": "abs", "data": {"axis": "x", "value": x * 32767 // (w - 1)}},
                {"type": "abs", "data": {"axis": "y", "value": y * 32767 // (h - 1)}}]
        btn = [{"type": "btn", "data": {"down": d, "button": button}} for d in (True, False)]
        await qemu.qmp(self._qmp_sock(handle), ("input-send-event", {"events": move + btn}))


__all__ = ["CONSOLE_SHELL", "DESKTOP", "KEYS", "VMBackend"]
