"""Network namespaces as the nodes of a benchmark: ``Nodes(count)`` makes one namespace per node,
each with one address on a bridge in a namespace of its own (the switch), and removes them all
when it ends. Everything stays on this machine: no interface of the machine's own namespace is
touched. Needs Linux, root and iproute2's ``ip``; ``Nodes.unavailable()`` says why not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

__all__ = ["Nodes"]


class Nodes:
    """``count`` network namespaces on one bridge: node i is ``names[i]`` at ``addresses[i]``."""

    def __init__(self, count: int, subnet: str = "10.231.11") -> None:
        tag = f"bn{os.getpid() % 100000}"
        self.switch = f"{tag}sw"
        self.names = [f"{tag}n{i}" for i in range(count)]
        self.links = [f"{tag}v{i}" for i in range(count)]  # the node's end of its cable; the switch's ends have "s"
        self.addresses = [f"{subnet}.{i + 1}" for i in range(count)]

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None:
            return "network namespaces need Linux, root and iproute2's `ip`"
        return None

    def __enter__(self) -> Nodes:
        try:
            self._run(["ip", "netns", "add", self.switch])
            self._run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            self._run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for name, link, address in zip(self.names, self.links, self.addresses, strict=True):
                port = f"{link}s"
                self._run(["ip", "netns", "add", name])
                self._run(["ip", "link", "add", link, "netns", name, "type", "veth", "peer", "name", port,
                           "netns", self.switch])
                self._run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
                self._run(["ip", "-n", name, "addr", "add", f"{address}/24", "dev", link])
                self._run(["ip", "-n", name, "link", "set", link, "up"])
                self._run(["ip", "-n", name, "link", "set", "lo", "up"])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for name in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)

    def prefix(self, node: int) -> list[str]:
        """What runs a command in node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node]]

    def link(self, node: int, up: bool) -> None:
        """Set node ``node``'s end of its cable up or down (down: the node is cut off the network)."""
        self._run(["ip", "-n", self.names[node], "link", "set", self.links[node], "up" if up else "down"])

    @staticmethod
    def _run(command: list[str]) -> None:
        subprocess.run(command, check=True, capture_output=True, timeout=30)
