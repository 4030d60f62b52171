"""What counts as this machine: the one loopback test for registries, redirect targets, leaders
to forward to and a simulated runtime's listen address."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address (without port or brackets) is this machine's loopback:
    `localhost`, 127.0.0.0/8 or ::1. Any other name may resolve anywhere, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
