"""Starting and watching worker processes: the ``ddpkit run`` command line (``cli``), the launcher
that runs a script on every local rank (``launcher``, also ``launch(fn)``), the bootstrap each
worker runs before the script (``worker``), in-script launching for ``DDPStrategy``
(``in_script``) and the shared process handling and root-cause choice (``processes``).

The launcher process never imports the DDP module or the strategy.
"""
