"""Who trains together: the connection to the default group, the group of each generation,
and the generations' keys and layouts in the store.

Nothing is imported here: importing one module of the folder imports no other (``ddpkit run``
reads parts of ``store`` and ``membership`` without torch)."""
