"""libnftables in-process, and the text of this host agent's ruleset (``table inet <table>``):
the static base rules, the per-sandbox set elements, and reading those elements back."""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import json
import re
from typing import Any

from bus import subjects as S

from .config import COUNTERS, FAMILY_PREFIX, NetworkConfig

__all__ = ["Nft", "NftError", "base_ruleset", "elements_cmd", "list_elements", "ALLOW_SETS"]

ALLOW_SETS = ("allow_net", "allow_port")


class Nft:
    """libnftables in-process (no fork/exec per sandbox). Not thread-safe: one owner thread."""

    _OUTPUT_JSON = 1 << 4

    def __init__(self) -> None:
        path = ctypes.util.find_library("nftables") or "libnftables.so.1"
        lib = ctypes.CDLL(path)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self._lib = lib
        self._ctx = self._new(0)
        self._jctx = self._new(self._OUTPUT_JSON)

    def _new(self, flags: int) -> int:
        ctx: int = self._lib.nft_ctx_new(0)
        if not ctx:
            raise OSError("nft_ctx_new failed")
        self._lib.nft_ctx_buffer_output(ctx)
        self._lib.nft_ctx_buffer_error(ctx)
        if flags:
            self._lib.nft_ctx_output_set_flags(ctx, flags)
        return ctx

    def run(self, cmd: str, *, json_out: bool = False) -> str:
        ctx = self._jctx if json_out else self._ctx
        rc = self._lib.nft_run_cmd_from_buffer(ctx, cmd.encode())
        out = (self._lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
        err = (self._lib.nft_ctx_get_error_buffer(ctx) or b"").decode()
        if rc != 0:
            raise NftError(err.strip() or f"nft failed (rc={rc})")
        return out

    def close(self) -> None:
        for ctx in (self._ctx, self._jctx):
            if ctx:
                self._lib.nft_ctx_free(ctx)
        self._ctx = self._jctx = 0


class NftError(RuntimeError):
    pass


def base_ruleset(cfg: NetworkConfig, deny_nets: list[ipaddress.IPv4Network], guard: bool) -> str:
    """The whole static ruleset as one transaction: rules replaced, set elements kept. ``guard``:
    nobody forwarded before us, so forward nothing but sandbox traffic."""
    t = f"inet {cfg.table}"
    p = f'"{cfg.ifprefix}*"'
    # TCP gets a reset (never rate-limited: a blocked connect fails at once, ECONNREFUSED);
    # the rest ICMP admin-prohibited (EHOSTUNREACH; the kernel rate-limits these per peer).
    rej = "reject with icmpx admin-prohibited"
    deny = ", ".join(str(n) for n in deny_nets)

    def logged(chain: str, match: str, counter: str) -> list[str]:
        if cfg.log_group < 0:
            return []
        m = f"{match} " if match else ""
        bucket = f"update @drop_log {{ iifname limit rate {cfg.log_rate_per_s}/second burst {cfg.log_burst} packets }}"
        return [f'add rule {t} {chain} {m}{bucket} counter name "logged" log prefix "{S.NFLOG_PREFIX} {counter}" group {cfg.log_group} snaplen 96']

    def reject(chain: str, match: str, counter: str) -> list[str]:
        m = f"{match} " if match else ""
        return [
            *logged(chain, match, counter),
            f'add rule {t} {chain} {m}meta l4proto tcp counter name "{counter}" reject with tcp reset',
            f'add rule {t} {chain} {m}counter name "{counter}" {rej}',
        ]

    lines = [
        f"add table {t}",
        f"add set {t} deny_net {{ type ipv4_addr; flags interval; auto-merge; }}",
        f"add set {t} allow_net {{ type ifname . ipv4_addr; flags interval; }}",
        f"add set {t} allow_port {{ type ifname . ipv4_addr . inet_proto . inet_service; flags interval; }}",
        # one token bucket per sandbox veth for the drop log; idle ones expire
        f"add set {t} drop_log {{ type ifname; flags dynamic,timeout; timeout 60s; size 65536; }}",
        *(f"add counter {t} {c}" for c in COUNTERS),
        f"add chain {t} sbx_input {{ type filter hook input priority filter - 10; policy accept; }}",
        f"add chain {t} sbx_forward {{ type filter hook forward priority filter - 10; policy accept; }}",
        f"add chain {t} sbx_egress",
        f"add chain {t} sbx_nat {{ type nat hook postrouting priority srcnat; policy accept; }}",
        f"flush set {t} deny_net",
        f"add element {t} deny_net {{ {deny} }}",
        *(f"flush chain {t} {c}" for c in ("sbx_input", "sbx_forward", "sbx_egress", "sbx_nat")),
        # The host itself: any local address (its IPs, 127/8, the veth's own .1) -- services,
        # NATS, the host agent. Nothing from a sandbox is delivered locally.
        *reject("sbx_input", f"iifname {p}", "to_host"),
        *reject("sbx_forward", f"iifname {p} oifname {p}", "between_sandboxes"),
        f"add rule {t} sbx_forward iifname {p} jump sbx_egress",
        # Into a sandbox: only replies, and only from what *its* allowlist names (a /30 is
        # reused after its old owner is gone; a stale conntrack entry must not let the old
        # owner's peers in), plus ICMP errors about its own flows (path MTU).
        f"add rule {t} sbx_forward oifname {p} ct state established,related oifname . ip saddr @allow_net accept",
        f"add rule {t} sbx_forward oifname {p} ct state established,related meta l4proto {{ tcp, udp }} "
        "oifname . ip saddr . meta l4proto . th sport @allow_port accept",
        f"add rule {t} sbx_forward oifname {p} ct state related meta l4proto icmp accept",
        f'add rule {t} sbx_forward oifname {p} counter name "inbound" drop',
        *logged("sbx_egress", "meta nfproto ipv6", "ipv6"),
        f'add rule {t} sbx_egress meta nfproto ipv6 counter name "ipv6" {rej}',
        *logged("sbx_egress", "fib saddr . iif oif missing", "spoofed"),
        f'add rule {t} sbx_egress fib saddr . iif oif missing counter name "spoofed" drop',
        *reject("sbx_egress", "ip daddr @deny_net", "denied"),
        # no "established" shortcut: every packet out is checked against this veth's elements
        f"add rule {t} sbx_egress iifname . ip daddr @allow_net accept",
        f"add rule {t} sbx_egress meta l4proto {{ tcp, udp }} iifname . ip daddr . meta l4proto . th dport @allow_port accept",
        *reject("sbx_egress", "", "not_allowed"),
        f"add rule {t} sbx_nat iifname {p} oifname != {p} masquerade",
    ]
    if guard:
        fam = f'"{FAMILY_PREFIX}*"'
        lines.append(f'add rule {t} sbx_forward iifname != {fam} oifname != {fam} counter name "forward_guard" drop')
    return "\n".join(lines) + "\n"


def elements_cmd(table: str, verb: str, elements: dict[str, list[str]]) -> str:
    """``add``/``delete`` commands for set elements (set name -> element texts)."""
    t = f"inet {table}"
    return "".join(f"{verb} element {t} {s} {{ {', '.join(els)} }}\n" for s, els in elements.items() if els)


def list_elements(nft: Nft, table: str) -> dict[str, list[tuple[str, str]]]:
    """set -> [(ifname, element text)] of the table's allow sets."""
    out: dict[str, list[tuple[str, str]]] = {s: [] for s in ALLOW_SETS}
    for s in out:
        doc = json.loads(nft.run(f"list set inet {table} {s}", json_out=True))
        for item in doc.get("nftables", []):
            for el in (item.get("set") or {}).get("elem", []) or []:
                if isinstance(el, dict) and "elem" in el:  # an element with options
                    el = el["elem"].get("val", el["elem"])
                parts = el.get("concat") if isinstance(el, dict) else None
                if not parts:
                    continue
                out[s].append((parts[0], " . ".join(_json_val(p) for p in parts)))
    return out


def _json_val(v: Any) -> str:
    if isinstance(v, dict):
        if "prefix" in v:
            return f"{v['prefix']['addr']}/{v['prefix']['len']}"
        if "range" in v:
            return f"{v['range'][0]}-{v['range'][1]}"
    if isinstance(v, str) and not re.fullmatch(r"[\d.]+|tcp|udp", v):
        return json.dumps(v)
    return str(v)
