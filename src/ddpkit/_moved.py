"""The module paths of ddpkit 0.1, kept importable after the parts moved into packages.

``import ddpkit.hangs`` (documented in 0.1) gives the module now at ``ddpkit.diagnostics.hangs``:
the same module object under both names, imported only when asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["MOVED_MODULES", "install"]

MOVED_MODULES = {
    "ddpkit.batchnorm": "ddpkit.parallel.batchnorm",
    "ddpkit.buckets": "ddpkit.parallel.buckets",
    "ddpkit.cli": "ddpkit.launching.cli",
    "ddpkit.ddp": "ddpkit.parallel.ddp",
    "ddpkit.debug": "ddpkit.diagnostics.debug",
    "ddpkit.failures": "ddpkit.diagnostics.failures",
    "ddpkit.hangs": "ddpkit.diagnostics.hangs",
    "ddpkit.launcher": "ddpkit.launching.launcher",
    "ddpkit.sparse": "ddpkit.parallel.sparse",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # executed already, under its new name


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
