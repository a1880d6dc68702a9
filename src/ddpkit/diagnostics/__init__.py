"""What ddpkit tells users when something goes wrong: one rank's failure named on every rank
(``failures``, written as ``records``), hang diagnosis (``hangs``) and the debug-mode
collective mismatch guard (``debug``).

Imports nothing else of ddpkit but its loggers (``ddpkit.logs``), so every other part can use it.
"""
