"""The training loop's side: the strategy, the resumable loop, in-place recovery and what it moves,
the per-step agreement (preemption among it), data, checkpoints and the tracked training state.

Nothing is imported here: importing one module of the folder imports no other (``ddpkit run``
reads parts of ``store`` and ``membership`` without torch)."""
