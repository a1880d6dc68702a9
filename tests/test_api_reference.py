"""The API reference (issue 64, item 6) is built from the docstrings by pdoc, without a warning:
the public modules each get a page, and every name ``import ddpkit`` offers is on ddpkit's. The
command is docs/api.md's; .ci/run installs pdoc with the test extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit

# The modules a user imports, as docs/api.md lists them.
PUBLIC_MODULES = ["ddpkit", "ddpkit.distributed", "ddpkit.environments", "ddpkit.hooks", "ddpkit.lightning",
                  "ddpkit.testing", "ddpkit.diagnostics.failures", "ddpkit.diagnostics.hangs", "ddpkit.diagnostics.debug"]


def test_the_api_reference_builds_from_the_docstrings_without_a_warning(tmp_path: Path) -> None:
    if importlib.util.find_spec("pdoc") is None:
        pytest.skip("pdoc is not installed (pip install -e '.[test]' installs it)")
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("ddpkit.lightning's page needs Lightning (pip install -e '.[test]' installs it)")
    result = subprocess.run([sys.executable, "-W", "error", "-m", "pdoc", *PUBLIC_MODULES, "-o", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    pages = {str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*.html")}
    assert {module.replace(".", "/") + ".html" for module in PUBLIC_MODULES} <= pages, pages
    front = (tmp_path / "ddpkit.html").read_text()
    missing = [name for name in ddpkit.__all__ if f'id="{name}"' not in front]
    assert not missing, f"on ddpkit's page without an entry: {missing}"
