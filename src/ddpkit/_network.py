"""Sockets: which network interface Gloo should use to reach the other nodes, free ports for
whoever starts processes (the launcher, in-script launching; never an environment), and where the
job's stores listen (``store_bind_address``, ``listen_on``).

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
import os
import socket
import struct

from ddpkit.variables import DDPKIT_STORE_BIND

__all__ = ["address_towards", "find_free_port", "gloo_interface_towards", "listen_on", "store_bind_address"]

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


def address_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host``: where the other nodes of a job reach it."""
    return _source_address_towards(socket.gethostbyname(host), port)


def _source_address_towards(ip: str, port: int) -> str:
    """The local address the kernel would use to reach ``ip`` (connecting UDP sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, port or 9))
        address: str = probe.getsockname()[0]
        return address


def _addresses_of_host_name() -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except (OSError, UnicodeError):
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


def store_bind_address(master_address: str, across_nodes: bool) -> str:
    """Where a store of the job listens (``listen_on``): the master address, so that only the
    network the job uses reaches it (a single-node job's 127.0.0.1: nobody outside this machine);
    every interface ("") when ``DDPKIT_STORE_BIND=all`` asks, or when the address resolves to a
    loopback one here while other nodes must reach it (a host name that /etc/hosts maps to
    127.0.1.1 here, as Debian does, and DNS to a routable address elsewhere)."""
    if os.environ.get(DDPKIT_STORE_BIND, "").strip().lower() == "all":
        return ""
    try:
        resolved = socket.getaddrinfo(master_address, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError, IndexError):
        return ""  # the connection that follows says what is wrong with the address
    if across_nodes and ipaddress.ip_address(str(resolved).partition("%")[0]).is_loopback:
        return ""
    return str(resolved)


def listen_on(address: str, port: int) -> socket.socket:
    """A socket listening on ``address`` ("" for every interface) and ``port``, inheritable, for a
    store's ``master_listen_fd`` (torch's TCPStore listens on every interface when it binds
    itself). ``OSError`` when the address is not this machine's or the port is taken."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(512)
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener
