"""mixloop: explicit mixed-precision training for TensorFlow 2 and Keras 3."""

from mixloop.actions import Action
from mixloop.layer_precision import build_model, keep_float32_layers
from mixloop.loss import Loss
from mixloop.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale, all_finite
from mixloop.objective import Objective
from mixloop.policy import Policy
from mixloop.step import TrainStep
from mixloop.trainer import Trainer

__all__ = [
    "Action",
    "DynamicLossScale",
    "Loss",
    "NoLossScale",
    "Objective",
    "Policy",
    "StaticLossScale",
    "TrainStep",
    "Trainer",
    "all_finite",
    "build_model",
    "keep_float32_layers",
]
__version__ = "0.1.0"
