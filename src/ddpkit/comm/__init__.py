"""Communication: the primitives below the diagnostics seam, the seam itself (``collective_call``)
and the public collectives built on it.

Nothing is imported here: importing one module of the folder imports no other (``ddpkit run``
reads parts of ``store`` and ``membership`` without torch)."""
