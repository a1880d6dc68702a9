"""The job's store: every key it holds (keys), the job secret and the signed records, the
wrappers a group forms through, and the bounded client every launcher and worker reads it with.

Nothing is imported here: importing one module of the folder imports no other (``ddpkit run``
reads parts of ``store`` and ``membership`` without torch)."""
