"""The local worker processes a launcher starts and watches: their processes and process groups
(``processes``: start, stop, the root cause among the ones that ended), their output
(``output``), the bootstrap each runs before the script (``worker``: ``python -m
ddpkit.workers.worker``), the node's warm template they fork from (``worker_template``), the
function pool behind ``launch(fn)`` (``pool``) and the in-place replacement of a lost one
(``replacement``).

Torch-free, as the launcher is: the workers import torch, the processes that start them never do.
Nothing here imports the launcher's command line, its restart loop or the cross-node parts.
"""
