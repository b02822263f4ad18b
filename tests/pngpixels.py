"""Pixels of a screenshot without an imaging library: the VM backend's PNGs (QMP ``screendump``)
decoded with zlib, for tests and benchmarks that look for a colour on the screen."""

from __future__ import annotations

import struct
import zlib


def png_pixels(png: bytes, rgb: tuple[int, int, int]) -> int:
    """How many pixels of the (8-bit RGB or RGBA, non-interlaced) PNG are exactly ``rgb``."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h, bpp = 8, bytearray(), 0, 0, 3
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        body = png[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride = zlib.decompress(bytes(idat)), w * bpp
    prev, found = bytearray(stride), 0
    for y in range(h):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride) if kind else ():  # undo the row's filter (PNG spec, 9.2)
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if kind == 1:
                line[x] = (line[x] + a) & 255
            elif kind == 2:
                line[x] = (line[x] + b) & 255
            elif kind == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        found += sum(1 for px in zip(line[0::bpp], line[1::bpp], line[2::bpp], strict=True) if px == rgb)
        prev = line
    return found


__all__ = ["png_pixels"]
