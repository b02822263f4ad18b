"""Veth and netns plumbing, on the network worker thread only: the kernel handles (pyroute2 for the
rare paths, raw rtnetlink and libnftables for the hot one), making a sandbox's netns + veth +
addresses + route, handing a pre-made one to a sandbox, and the link and address look-ups the
other parts need."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from typing import Any

import structlog

from . import netns
from .attachment import Attachment
from .config import NetworkConfig
from .nftables import Nft
from .rtnetlink import Rtnl

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["Plumbing", "Link"]

# (host ifname, ifindex, alias)
Link = tuple[str, int, str]
_HOST_ADDRS_TTL_S = 2.0


class Plumbing:
    """This agent's kernel handles. ``unavailable`` says why no further network work is possible
    (the worker thread could not return to the host netns), or is empty."""

    def __init__(self, cfg: NetworkConfig) -> None:
        self.cfg = cfg
        self.unavailable = ""
        self._ipr: Any = None
        self._nl: Rtnl | None = None
        self._nft: Nft | None = None
        self._root_ns_fd = -1
        self._root_ns_ino = 0
        self._host_addrs: tuple[float, set[ipaddress.IPv4Address]] = (0.0, set())

    def init(self) -> None:
        if self._ipr is not None:
            return
        from pyroute2 import IPRoute

        self._root_ns_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._root_ns_ino = os.fstat(self._root_ns_fd).st_ino
        netns.writable_proc_sys()  # (in a container: mounted read-only by its engine)
        self._ipr = IPRoute()
        self._nl = Rtnl()
        self._nft = Nft()

    def close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None
        if self._nl is not None:
            self._nl.close()
            self._nl = None
        if self._nft is not None:
            self._nft.close()
            self._nft = None
        if self._root_ns_fd >= 0:
            os.close(self._root_ns_fd)
            self._root_ns_fd = -1

    @property
    def nft(self) -> Nft:
        assert self._nft is not None, "Plumbing.init() first"
        return self._nft

    @property
    def nl(self) -> Rtnl:
        assert self._nl is not None, "Plumbing.init() first"
        return self._nl

    def check_root_ns(self) -> None:
        if os.stat("/proc/thread-self/ns/net").st_ino != self._root_ns_ino:
            raise RuntimeError("network worker thread is not in the host netns")

    # --- look-ups ---------------------------------------------------------------------------------
    def links(self) -> list[Link]:
        """This agent's host-side veths (by prefix)."""
        out = []
        for link in self._ipr.get_links():
            name = link.get_attr("IFLA_IFNAME") or ""
            if name.startswith(self.cfg.ifprefix):
                out.append((name, int(link["index"]), link.get_attr("IFLA_IFALIAS") or ""))
        return out

    def link_index(self, name: str) -> int | None:
        found = self._ipr.link_lookup(ifname=name)
        return int(found[0]) if found else None

    def link_exists(self, name: str) -> bool:
        try:
            self.nl.index_of(name)
            return True
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return False
            raise

    def addresses(self, index: int) -> list[str]:
        return [a.get_attr("IFA_ADDRESS") for a in self._ipr.get_addr(family=socket.AF_INET, index=index)]

    def host_addrs(self) -> set[ipaddress.IPv4Address]:
        """Every IPv4 address of the host (cached briefly: a burst of creates asks once)."""
        at, addrs = self._host_addrs
        if time.monotonic() - at > _HOST_ADDRS_TTL_S:
            addrs = {ipaddress.IPv4Address(a.get_attr("IFA_ADDRESS")) for a in self._ipr.get_addr(family=socket.AF_INET)}
            self._host_addrs = (time.monotonic(), addrs)
        return addrs

    def del_link(self, name: str) -> None:
        try:
            self._ipr.link("del", ifname=name)
        except Exception as exc:  # noqa: BLE001
            if "No such device" not in str(exc):
                log.warning("veth_delete_failed", ifname=name, error=str(exc))

    # --- making and handing over networks --------------------------------------------------------
    def make_netns(self, att: Attachment, alias: str, existing: str = "") -> None:
        """netns + veth + addresses + route: 3 netlink round trips, raw (pyroute2 serves the rare
        paths: dumps, recovery, deletes -- its per-call overhead is most of the cost here).
        ``existing``: a netns to use instead of a new one (a warm container's own, empty one, as
        ``/proc/<pid>/ns/net``), pinned at the attachment's path as a new one is."""
        path = att.netns
        netns.mountpoint(path)  # (a leftover of a crashed create of this very sandbox goes first)
        ns_nl: Rtnl | None = None
        try:
            if existing:
                if os.stat(existing).st_ino == self._root_ns_ino:
                    raise OSError(errno.EINVAL, f"{existing} is the host's netns")
                netns.bind_mount(existing, path)
            try:
                if existing:
                    self._enter(path)
                else:
                    netns.unshare_net()
                    netns.bind_mount("/proc/thread-self/ns/net", path)
                # Inside the new netns: unprivileged ICMP echo sockets (no CAP_NET_RAW needed for
                # ping), no IPv6 anywhere; a netlink socket that stays bound to this netns.
                for key, val in (("ipv4/ping_group_range", "0 2147483647"), ("ipv6/conf/all/disable_ipv6", "1"), ("ipv6/conf/default/disable_ipv6", "1")):
                    with open(f"/proc/sys/net/{key}", "w") as f:
                        f.write(val)
                ns_nl = Rtnl()
            finally:
                err = netns.setns_net(self._root_ns_fd)
                if err:
                    # This thread is stuck in a sandbox's netns: refuse all further network work.
                    self.unavailable = "network worker could not return to the host netns"
                    log.critical("netns_setns_back_failed", errno=err)
            self.check_root_ns()
            assert ns_nl is not None
            nsfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # the host end created up; the sandbox end named eth0, straight in its netns
                self.nl.call([Rtnl.new_veth(att.ifname, "eth0", nsfd)])
            finally:
                os.close(nsfd)
            idx = self.nl.index_of(att.ifname)
            with open(f"/proc/sys/net/ipv6/conf/{att.ifname}/disable_ipv6", "w") as f:
                f.write("1")
            self.nl.call([Rtnl.new_addr(idx, att.gateway, 30), Rtnl.set_alias(idx, alias[:255])])
            eth = ns_nl.index_of("eth0")
            ns_nl.call([Rtnl.set_up(1), Rtnl.set_up(eth), Rtnl.new_addr(eth, att.ip, 30), Rtnl.new_default_route(att.gateway)])  # lo: ifindex 1
        finally:
            if ns_nl is not None:
                ns_nl.close()

    @staticmethod
    def _enter(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            err = netns.setns_net(fd)
        finally:
            os.close(fd)
        if err:
            raise OSError(err, f"setns into {path}: {os.strerror(err)}")

    def rename(self, att: Attachment, path: str, sid: str) -> None:
        """Give a pre-made network to a sandbox: its netns gets the sandbox's name, its veth the
        sandbox id as alias. (A second bind mount, then the old one removed: MS_MOVE is refused
        under shared mount propagation.)"""
        netns.mountpoint(path)
        try:
            netns.bind_mount(att.netns, path)
        except OSError:
            os.unlink(path)
            raise
        netns.umount(att.netns)
        att.netns = path
        att.sandbox_id = sid
        self.nl.call([Rtnl.set_alias_by_name(att.ifname, sid[:255])])
