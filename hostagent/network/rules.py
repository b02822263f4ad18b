"""The nftables side of each sandbox: the static base ruleset of ``table inet <table>`` and the
per-sandbox set elements (keyed by host-side veth name) added, removed and garbage-collected."""

from __future__ import annotations

import ipaddress

import structlog

from .config import NetworkConfig
from .nftables import NftError, base_ruleset, elements_cmd, list_elements
from .plumbing import Plumbing

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["SandboxRules"]


class SandboxRules:
    """On the network worker thread only (libnftables is not thread-safe)."""

    def __init__(self, cfg: NetworkConfig, kernel: Plumbing) -> None:
        self.cfg = cfg
        self._kernel = kernel

    def apply_base(self, deny: list[ipaddress.IPv4Network], guard: bool) -> None:
        text = base_ruleset(self.cfg, deny, guard)
        try:
            self._kernel.nft.run(text)  # one transaction: rules replaced atomically, set elements kept
        except NftError as exc:
            # An incompatible older table (changed set or chain types): rebuild it from scratch;
            # live sandboxes' elements come back in recover().
            log.warning("nft_table_rebuilt", error=str(exc))
            self._kernel.nft.run(f"add table inet {self.cfg.table}\ndelete table inet {self.cfg.table}\n" + text)

    def has_table(self) -> bool:
        try:
            self._kernel.nft.run(f"list table inet {self.cfg.table}")
            return True
        except NftError:
            return False

    def drop_table(self) -> None:
        try:
            self._kernel.nft.run(f"delete table inet {self.cfg.table}")
        except NftError:
            pass

    def add(self, elements: dict[str, list[str]]) -> None:
        """Idempotent: re-adding what is there is not an error."""
        self._kernel.nft.run(elements_cmd(self.cfg.table, "add", elements))

    def remove(self, sid: str, ifname: str, elements: dict[str, list[str]] | None) -> None:
        """A sandbox's elements (``None``: not known, look them up by veth name). Never raises for
        'already gone'."""
        try:
            if elements is not None and any(elements.values()):
                try:
                    self._kernel.nft.run(elements_cmd(self.cfg.table, "delete", elements))
                except NftError:
                    self.gc(only={ifname})
            elif elements is None:
                self.gc(only={ifname})
        except NftError as exc:  # no table: no elements
            log.info("nft_elements_gone", sandbox_id=sid, error=str(exc))

    def gc(self, only: set[str] | None = None, keep: set[str] | None = None) -> int:
        """Delete elements of the given ifnames (``only``), or of every ifname not in ``keep``."""
        doomed: dict[str, list[str]] = {}
        for s, els in list_elements(self._kernel.nft, self.cfg.table).items():
            for ifn, text in els:
                if (only is not None and ifn in only) or (keep is not None and ifn not in keep):
                    doomed.setdefault(s, []).append(text)
        if doomed:
            self._kernel.nft.run(elements_cmd(self.cfg.table, "delete", doomed))
        return sum(len(v) for v in doomed.values())
