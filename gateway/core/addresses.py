"""Network addresses: which hosts only reach this machine.

Shared by the server (plaintext bearer keys only on loopback) and the client and CLI (the
development key is offered only to a loopback gateway).
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine (a key may travel there without TLS)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
