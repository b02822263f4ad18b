"""Cleanup and reconcile: the kernel is the record. After a restart the /30s in use are re-learned
from the host ends' addresses, live sandboxes' allowlists are re-armed and everything of this
agent's that belongs to no live sandbox (veths, netns mounts, set elements) is removed; a purge
removes all of it. On the network worker thread only."""

from __future__ import annotations

import os
from typing import Any

import structlog

from . import forwarding, netns
from .attachment import Attachment
from .config import NetworkConfig
from .plumbing import Plumbing
from .rules import SandboxRules
from .slots import SlotPool

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["Reconciler"]


class Reconciler:
    """``atts``: the manager's live attachments by sandbox id (shared, updated in place)."""

    def __init__(self, cfg: NetworkConfig, kernel: Plumbing, rules: SandboxRules, slots: SlotPool, atts: dict[str, Attachment]) -> None:
        self.cfg = cfg
        self._kernel = kernel
        self._rules = rules
        self._slots = slots
        self._atts = atts

    def has_state(self) -> bool:
        """Anything of this config's in the kernel (table, veths, netns mounts)?"""
        if self._rules.has_table() or self._kernel.links():
            return True
        return bool(self._netns_names())

    def learn_slots(self) -> None:
        """Which /30s are taken: from the host ends of our veths."""
        for name, index, _alias in self._kernel.links():
            for ip in self._kernel.addresses(index):
                slot = self._slots.slot_of(ip)
                if slot is not None:
                    self._slots.learned(slot, name)

    def recover(self, alive: dict[str, dict[str, Any] | None]) -> None:
        """``alive``: each still-running sandbox's saved network extra (or None)."""
        keep_if: set[str] = set()
        readd: dict[str, list[str]] = {}
        for sid, extra in alive.items():
            if not extra:
                continue
            att = Attachment.from_extra(sid, extra)
            if self._kernel.link_index(att.ifname) is None:
                log.warning("recover_network_lost", sandbox_id=sid)  # fail closed: no veth, no egress
                continue
            self._atts[sid] = att
            self._slots.claim(att.slot, sid)
            keep_if.add(att.ifname)
            for s, els in att.elements.items():
                readd.setdefault(s, []).extend(els)
        if readd:
            self._rules.add(readd)  # idempotent; back after a table rebuild
        removed = self._rules.gc(keep=keep_if)
        # veths and netns mounts of sandboxes that are gone
        orphans = 0
        for name, _index, _alias in self._kernel.links():
            if name not in keep_if:
                self._kernel.del_link(name)
                orphans += 1
        live_ns = {a.netns for a in self._atts.values()}
        for p in self._netns_names():
            if p not in live_ns:
                netns.umount(p)
                orphans += 1
        self._slots.continue_after_used()
        log.info("network_recovered", live=len(self._atts), stale_elements=removed, orphans=orphans)

    def purge(self) -> None:
        """Everything of this config's out of the kernel (once its sandboxes are torn down) and
        ip_forward back as it was."""
        self._rules.drop_table()
        for name, _index, _alias in self._kernel.links():
            self._kernel.del_link(name)
        for p in self._netns_names():
            netns.umount(p)
        forwarding.restore(self.cfg)
        self._slots.clear()

    def _netns_names(self) -> list[str]:
        """Paths of this config's netns mounts."""
        try:
            names = os.listdir(self.cfg.netns_dir)
        except FileNotFoundError:
            return []
        return [os.path.join(self.cfg.netns_dir, n) for n in names if n.startswith(self.cfg.netns_prefix)]
