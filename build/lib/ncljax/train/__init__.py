"""Training: state, the jitted step, mesh, checkpoints, metric writers and the main loop."""

from ncljax.config import base_config
from ncljax.train.loop import train_and_evaluate
from ncljax.train.state import TrainState

__all__ = ["TrainState", "base_config", "train_and_evaluate"]
