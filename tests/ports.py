"""A free TCP port for torchrun's rendezvous.

Ports derived from the test process's pid collide between tests of one session (and with a port a
just-finished run still holds), which hangs the second launch until its timeout; the kernel's
choice of an unused port does not.
"""

from __future__ import annotations

import socket


def free_port() -> str:
    """A port no socket on this machine holds now, as torchrun's --master_port wants it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])
