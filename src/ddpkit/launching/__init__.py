"""The launcher: the ``ddpkit run`` command line and its checked configuration (``cli``,
``config``, ``usage``, ``torchrun_flags``), the restart loop that runs a script on every local rank
(``launcher``, also ``launch(fn)``) and watches each start (``watch``), the variables each worker is
told (``worker_environment``), in-script launching for ``DDPStrategy`` (``in_script``), and the
launcher's side across nodes: the rendezvous, the store it hosts, joining the nodes, a spare node
(``rendezvous``, ``store_host``, ``joining``, ``spare_node``). The processes themselves are
``ddpkit.workers``', the job's health ``ddpkit.health``'s, the agreement between launchers
``ddpkit.control_plane``'s.

The launcher process never imports the DDP module or the strategy.
"""
