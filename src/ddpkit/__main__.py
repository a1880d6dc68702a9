"""``python -m ddpkit run ...`` and the ``ddpkit`` command."""

import sys

from ddpkit.logs import log_level_problem


def main() -> int:
    """``ddpkit run``: a malformed ``DDPKIT_LOG_LEVEL`` is refused in one line before the launcher's
    modules, which make their loggers as they are imported, are loaded."""
    problem = log_level_problem()
    if problem is not None:
        print(f"ddpkit run: {problem}", file=sys.stderr)
        return 2
    from ddpkit.launching.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
