"""The control plane across nodes: how the launchers of a multi-node job agree through the job's
store (``nodes.NodeCoordination``, over its parts: the signed records and their logs, the beats
and who watches whose, a launcher's look at the job, the claims on a lost node's place, the world's
nodes as they change). Its work per node is constant in the number of nodes (docs/scale.md,
``benchmarks/control_plane.py``). It imports the store, the membership's generations and the
diagnostics' relayed news, never the launcher's processes or the worker's training side.
"""
