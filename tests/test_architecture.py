"""The layout rules of docs/architecture.md, checked on the source: the document names every
module and only existing ones, imports go the documented way, names are spelled once."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "ddpkit"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> list[str]:
    """Every module of the package as a path relative to src/ddpkit, e.g. 'parallel/ddp.py'."""
    return sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py"))


def imported_ddpkit_modules(relative: str) -> set[str]:
    """The ddpkit modules a module imports anywhere in its body (function-level imports too)."""
    tree = ast.parse((PACKAGE / relative).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddpkit"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("ddpkit"))
    return found


def test_the_architecture_document_names_every_module_and_only_existing_ones() -> None:
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"`([a-z_/]+\.py)", text))
    existing = set(modules())
    assert named - existing == set(), "named in docs/architecture.md but missing"
    # A subpackage's __init__ is named by its folder's docstring; every other module by its path.
    unnamed = {m for m in existing - named if not m.endswith("/__init__.py")}
    assert unnamed == set(), "modules docs/architecture.md does not name"


@pytest.mark.parametrize(("part", "forbidden"), [
    ("diagnostics/", ("ddpkit.",)),  # imports nothing else of ddpkit but the loggers, the variables and the secret
    ("job_secret.py", ("ddpkit.",)),  # the launcher and the diagnostics read it: no torch, nothing that imports it
    ("generations.py", ("ddpkit.",)),  # the launcher and the group share it: no torch, only the secret
    ("variables.py", ("ddpkit.",)),  # names only: every part may import it
    ("environments/", ("ddpkit.connection", "ddpkit.collectives", "ddpkit.parallel", "ddpkit.strategy",
                       "ddpkit.launching", "ddpkit.diagnostics")),
    ("hooks/", ("ddpkit.parallel", "ddpkit.strategy")),
    ("logs.py", ("ddpkit.",)),
    ("preemption.py", ("ddpkit.",)),  # the launcher imports it: no torch, nothing that imports it
    ("_allocator.py", ("ddpkit.",)),  # the launcher imports it too
    ("agreement.py", ("ddpkit.parallel", "ddpkit.strategy", "ddpkit.launching")),
    ("recovery.py", ("ddpkit.strategy", "ddpkit.launching")),  # the strategy uses it, not the other way
    ("collectives.py", ("ddpkit.parallel", "ddpkit.strategy", "ddpkit.hooks")),
    ("collective_call.py", ("ddpkit.parallel", "ddpkit.strategy", "ddpkit.hooks")),
    ("connection.py", ("ddpkit.parallel", "ddpkit.strategy", "ddpkit.collective")),
    ("parallel/", ("ddpkit.strategy", "ddpkit.launching")),
    ("launching/", ("ddpkit.parallel", "ddpkit.strategy", "ddpkit.collective")),
])
def test_imports_go_the_documented_way(part: str, forbidden: tuple[str, ...]) -> None:
    for module in modules():
        if not module.startswith(part):
            continue
        own_part = "ddpkit." + part.rstrip("/").removesuffix(".py").replace("/", ".")
        for imported in imported_ddpkit_modules(module):  # every part may use the loggers, variables and secret
            if imported.startswith(own_part) or imported in ("ddpkit.logs", "ddpkit.variables", "ddpkit.job_secret"):
                continue
            assert not imported.startswith(forbidden), f"{module} imports {imported}"


def test_every_ddpkit_variable_is_spelled_in_one_module() -> None:
    """``DDPKIT_*`` names as string literals (messages too; docstrings aside) only in variables.py."""
    spelled = []
    for module in modules():
        tree = ast.parse((PACKAGE / module).read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        spelled += [f"{module}:{node.lineno}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and "DDPKIT_" in node.value
                    and id(node) not in docstrings and module != "variables.py"]
    assert spelled == [], "spell them through ddpkit.variables"


def test_collectives_and_connection_know_no_module() -> None:
    for module in ("collectives.py", "collective_call.py", "connection.py"):
        assert "nn.Module" not in (PACKAGE / module).read_text(), module


def test_the_launcher_imports_neither_the_ddp_module_nor_the_strategy() -> None:
    """What `ddpkit run` and a worker's bootstrap import before the user's script starts."""
    code = ("import sys, ddpkit.launching.cli, ddpkit.launching.worker; "
            "print(sorted(m for m in sys.modules if m in ('ddpkit.parallel.ddp', 'ddpkit.strategy')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


def test_public_names_resolve_and_launch_is_the_function() -> None:
    import ddpkit

    for name in ddpkit.__all__:
        assert getattr(ddpkit, name) is not None, name
    assert callable(ddpkit.launch) and ddpkit.launch.__module__ == "ddpkit.launching.launcher"
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        ddpkit.nothing_here  # noqa: B018


def test_the_public_names_are_one_list_the_type_checkers_see_too() -> None:
    """``__all__`` comes from ``_PUBLIC``; the imports for type checkers re-export the same names."""
    import ddpkit

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    reexported = {(statement.module, alias.asname) for statement in checked.body if isinstance(statement, ast.ImportFrom)
                  for alias in statement.names if alias.asname == alias.name}
    assert reexported == {(module, name) for module, names in ddpkit._PUBLIC.items() for name in names}
    assert ddpkit.__all__ == sorted(name for _, name in reexported)
