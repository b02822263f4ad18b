"""E2B's sandbox network options mapped to dsec's egress allowlist (sdk/gateway/_network.py): what
maps, and what is refused with invalid_argument rather than silently widened or ignored."""

from __future__ import annotations

import pytest

from bus.errors import InvalidArgument
from sdk.gateway._network import ALL_TRAFFIC, allow_out


def test_what_maps_to_the_allowlist() -> None:
    # Harbor's allowlist mode: allow these, deny all traffic
    doc = {"allow_internet_access": True, "network": {"allowOut": ["192.0.2.10", "example.com"], "denyOut": [ALL_TRAFFIC]}}
    assert allow_out(doc) == ["192.0.2.10", "example.com"]
    # no egress: access off, deny all without allows, or nothing asked (dsec's default)
    assert allow_out({"allow_internet_access": False}) is None
    assert allow_out({"network": {"denyOut": [ALL_TRAFFIC]}}) is None
    assert allow_out({}) is None and allow_out({"allow_internet_access": True, "network": None}) is None
    # allow_out wins over allow_internet_access=false (E2B's precedence); an update's body is the network itself
    assert allow_out({"allow_internet_access": False, "network": {"allowOut": ["10.1.2.3"], "denyOut": [ALL_TRAFFIC]}}) == ["10.1.2.3"]
    assert allow_out({"allowOut": ["10.1.2.3"], "denyOut": [ALL_TRAFFIC]}, network_key=None) == ["10.1.2.3"]
    assert allow_out({"allow_internet_access": False}, network_key=None) is None


@pytest.mark.parametrize("doc, why", [
    ({"network": {"denyOut": ["10.0.0.0/8"]}}, "only denyOut"),  # deny a few, allow the rest: not an allowlist
    ({"network": {"allowOut": ["a.example"], "denyOut": ["1.2.3.4"]}}, "only denyOut"),
    ({"network": {"allowOut": "192.0.2.1"}}, "list of non-empty strings"),
    ({"network": {"allowOut": [""]}}, "list of non-empty strings"),
    ({"network": ["x"]}, "must be an object"),
    ({"allow_internet_access": "yes"}, "must be a boolean"),
    ({"network": {"egressProxy": {"url": "http://p"}}}, "egressProxy is not supported"),
    ({"network": {"rules": {"a": {}}}}, "rules is not supported"),
    ({"network": {"allowPublicTraffic": False}}, "allowPublicTraffic"),
])
def test_what_is_refused(doc: dict, why: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        allow_out(doc)
    assert ei.value.code == "invalid_argument" and why in ei.value.description
