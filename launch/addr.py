"""This host's address as other hosts reach it."""

from __future__ import annotations

import os
import socket

from peerckpt.errors import ConfigurationError


def node_address(store_host: str) -> str:
    """This host's address for peer agents: ``PEERCKPT_NODE_ADDR`` if set, else the source
    address of a route to torchrun's store (the interface that reaches the other hosts)."""
    given = os.environ.get("PEERCKPT_NODE_ADDR")
    if given:
        return given
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((store_host, 9))  # UDP: no packet is sent, only a route chosen
        except OSError as exc:
            raise ConfigurationError(
                f"cannot find this host's address towards {store_host} ({exc}); set "
                "PEERCKPT_NODE_ADDR to the address other hosts reach this one on"
            ) from None
        return str(s.getsockname()[0])
