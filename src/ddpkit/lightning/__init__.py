"""Lightning's Trainer with ddpkit underneath: ``Trainer(strategy=ddpkit.lightning.DDPStrategy())``.

Needs Lightning 2 (``pip install "ddpkit[lightning]"``, or ``pip install lightning``); nothing else of
ddpkit imports this folder or Lightning. ``DDPPlugin`` is the seeds' name for the same strategy
(Lightning 1.x passed it in ``plugins=[...]``; Lightning 2 takes it as ``strategy=``)."""

from __future__ import annotations

try:
    import lightning.pytorch  # noqa: F401
except ImportError as missing:  # pragma: no cover - Lightning is in the test extra
    raise ImportError("ddpkit.lightning needs Lightning 2: pip install lightning (or pip install \"ddpkit[lightning]\"). "
                      f"Importing it failed: {missing}") from missing

from ddpkit.lightning.environment import DdpkitEnvironment
from ddpkit.lightning.layer_sync import DdpkitSyncBatchNorm
from ddpkit.lightning.strategy import DDPStrategy

DDPPlugin = DDPStrategy

__all__ = ["DDPPlugin", "DDPStrategy", "DdpkitEnvironment", "DdpkitSyncBatchNorm"]
