"""mixloop: explicit mixed-precision training for TensorFlow 2 and Keras 3."""

from mixloop import interrupts

interrupts.exit_quietly_while_starting()  # Before TensorFlow's import: only for the command.

from mixloop.engine.input_gradients import input_gradients
from mixloop.engine.layer_precision import build_model, keep_float32_layers
from mixloop.engine.loss import Loss
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale, all_finite
from mixloop.engine.objective import Objective
from mixloop.engine.policy import Policy
from mixloop.engine.micro_step import forward
from mixloop.engine.step import TrainStep
from mixloop.runner.actions import Action
from mixloop.runner.optimizers import build_optimizer
from mixloop.runner.trainer import Trainer

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
    "build_optimizer",
    "forward",
    "input_gradients",
    "keep_float32_layers",
]
__version__ = "0.1.0"
