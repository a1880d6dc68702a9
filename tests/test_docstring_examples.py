"""The ``Example::`` sections of the public API's docstrings run as doctests, in one process (world
size 1: a connection needs no network then), so that an example cannot rot. Those that need
several processes say ``doctest: +SKIP``."""

from __future__ import annotations

import os
import subprocess
import sys

MODULES = ("ddpkit.training.strategy", "ddpkit.parallel.ddp", "ddpkit.comm.collectives", "ddpkit.membership.connection",
           "ddpkit.hooks.default", "ddpkit.hooks.powersgd", "ddpkit.training.data", "ddpkit.launching.launcher",
           "ddpkit.environments.contract")

RUN = """
import doctest, importlib, sys
failed = attempted = 0
for name in sys.argv[1:]:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failed, attempted = failed + result.failed, attempted + result.attempted
    if not result.attempted:
        print(f"{name}: no example ran", flush=True)
        failed += 1
print(f"{attempted} examples, {failed} failed", flush=True)
sys.exit(1 if failed else 0)
"""


def test_the_public_apis_examples_run_as_written() -> None:
    done = subprocess.run([sys.executable, "-c", RUN, *MODULES], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DDPKIT_LOG_LEVEL": "ERROR"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
