"""Sockets: which network interface Gloo should use to reach the other nodes, and free ports
for whoever starts processes (the launcher, in-script launching; never an environment).

Without ``GLOO_SOCKET_IFNAME``, Gloo binds to the address this host's *name* resolves to, and
to loopback when that fails. Both are wrong surprisingly often across nodes: Debian and Ubuntu
map the host name to 127.0.1.1 in /etc/hosts, containers and network namespaces often cannot
resolve it, and the other nodes are then told to connect to a loopback address, which fails
only after the connect timeout. The interface that routes to the master address is the one
that can reach the other nodes, so ddpkit picks it when the user has not chosen one.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

__all__ = ["find_free_port", "gloo_interface_towards"]

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def gloo_interface_towards(master_address: str, master_port: int) -> str | None:
    """The name of the interface to give Gloo, or None when its default already works (or when
    this cannot be worked out: then Gloo's own choice stands)."""
    try:
        master_ip = socket.gethostbyname(master_address)
        if ipaddress.ip_address(master_ip).is_loopback:
            return None  # every process is on this host
        local_ip = _source_address_towards(master_ip, master_port)
        if ipaddress.ip_address(local_ip).is_loopback or local_ip in _addresses_of_host_name():
            return None  # Gloo's default (the host name's address) is the routed one
        return _interface_with_address(local_ip)
    except (OSError, ValueError):
        return None


def _source_address_towards(ip: str, port: int) -> str:
    """The local address the kernel would use to reach ``ip`` (connecting UDP sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, port or 9))
        address: str = probe.getsockname()[0]
        return address


def _addresses_of_host_name() -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        return set()


def _interface_with_address(ip: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name[:15].encode())
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(answer[20:24]) == ip:
                return name
    return None


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
