"""The job's health as the launchers see it: each window's step phases per rank and the stragglers
named (``job_health``), a node's link timed (``link_probe``), ``ddpkit report`` of a metrics file
(``report``) and a straggling node asked to step aside for a spare (``straggler_replacement``).

Torch-free, as the launcher is; it reads the workers' step windows (``diagnostics.step_windows``)
and the launchers' records (``control_plane``), never the launcher's processes or command line.
"""
