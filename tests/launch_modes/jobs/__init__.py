"""The training scripts of the launch-mode matrix (a package, so that `-m jobs.plain` runs one)."""
