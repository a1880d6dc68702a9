"""Data parallelism inside one training step: the DDP module (``ddp``), its gradient buckets
(``buckets``), sparse gradients (``sparse``) and batch norm over the whole group (``batchnorm``).

Depends on the collectives, the connection and the diagnostics; never starts processes and
needs no strategy.
"""
