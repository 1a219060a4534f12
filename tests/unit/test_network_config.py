from ipaddress import ip_network

import pytest

from vmctl.egress import EgressPolicy, HostFacts
from vmctl.network import NetworkConfig, nft_ruleset, slot_for


def test_slots_are_distinct_30s():
    cfg = NetworkConfig()
    a, b = slot_for(0, "a", cfg), slot_for(1, "b", cfg)
    assert a.host_addr == "169.254.128.1" and a.guest_addr == "169.254.128.2"
    assert b.host_addr == "169.254.128.5" and a.host_if != b.host_if
    assert len(a.host_if) <= 15


def test_pool_validation():
    with pytest.raises(ValueError, match="overlaps"):
        NetworkConfig(pool="169.254.0.0/16")
    with pytest.raises(ValueError):
        NetworkConfig(pool="10.0.0.0/31")


def test_deny_egress_ruleset_has_no_outbound_accept():
    slot = slot_for(0, "a", NetworkConfig())
    rules = nft_ruleset(slot, EgressPolicy(), HostFacts((), ip_network("169.254.128.0/17")))
    assert "policy drop" in rules and "masquerade" not in rules
    assert 'iifname "tap0" drop' in rules


def test_slots_holding_a_metadata_address_are_never_handed_out():
    from vmctl.network import NetworkConfig, slot_for, slot_reserved
    cfg = NetworkConfig()  # 169.254.128.0/17 holds 169.254.169.254
    reserved = [i for i in range(cfg.capacity) if slot_reserved(i, cfg)]
    assert [slot_for(i, "x", cfg).host_addr for i in reserved] == [
        "169.254.169.121", "169.254.169.253", "169.254.170.1"]  # .123 NTP, .254 IMDS, .170.2 ECS
    assert not any(slot_reserved(i, NetworkConfig(pool="169.254.64.0/18")) for i in range(4096))


def test_the_namespace_prefix_names_each_slot_and_is_checked():
    slot = slot_for(3, "abc", NetworkConfig(netns_prefix="hosta-"))
    assert slot.netns == "hosta-abc"
    for bad in ("", "Host-", "a", "a/b-", "x" * 30 + "-"):
        with pytest.raises(ValueError, match="netns_prefix"):
            NetworkConfig(netns_prefix=bad)
