"""``python -m ddpkit run ...`` and the ``ddpkit`` command."""

import os
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
    from ddpkit.store.client import requests_left_unanswered

    code = run()
    if requests_left_unanswered():
        # A thread still blocked in torch's store client, woken while the interpreter finalises,
        # would end the launcher with SIGABRT instead of the job's exit code: end without finalising.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
