"""tiny_experiment with mixloop's public helpers misused on purpose inside `compute_loss`, and a
model output that is not batch-shaped, one `config.model.misuse` value each, for the CLI tests of
the one-line errors they must give.

`misuse`: "" (none), "batch_mean" (a second output, the logits' batch mean of shape [3], which the
loss reads: with train.batch_loss the two passes must refuse it), "policy_string" (`forward`
given the policy as a string), "no_training" (`forward` without `training=`), "unrelated_input"
(`input_gradients` of a function that ignores its input), "integer_inputs" (`input_gradients`
with respect to the labels), "dict_fn" (a function returning a dict), "zero_scale"
(`input_gradients(..., scale=0)`), or in `build_optimizer` "no_optimizer" (returns None),
"optimizer_name" (returns the string "adam") and "every_steps_zero" (`mixloop.build_optimizer`
with every_steps=0).
"""

import keras
import tensorflow as tf

import mixloop
import tiny_experiment


class MisuseTrainer(tiny_experiment.TinyTrainer):
    """TinyTrainer whose compute_loss misuses what `config.model.misuse` names."""

    def build_model(self):
        model = super().build_model()
        if self.config.model.misuse != "batch_mean":
            return model
        mean = keras.layers.Lambda(lambda z: tf.reduce_mean(z, 0), name="mean")(model.outputs[0])
        return keras.Model(model.inputs, {"logits": model.outputs[0], "mean": mean})

    def build_optimizer(self):
        wrong = {"no_optimizer": None, "optimizer_name": "adam"}
        misuse = self.config.model.misuse
        if misuse == "every_steps_zero":
            return mixloop.build_optimizer(self.config, every_steps=0)
        return wrong[misuse] if misuse in wrong else super().build_optimizer()

    def compute_loss(self, outputs, batch):
        misuse = self.config.model.misuse
        if misuse == "batch_mean":
            return super().compute_loss(outputs["logits"], batch) + tf.reduce_sum(outputs["mean"]) ** 2
        return super().compute_loss(outputs, batch) + 0.0 * self.penalty(misuse, batch)

    def eval_metrics(self, outputs, batch):
        # compute_loss on the outputs as they are: TinyTrainer's would hand it the logits alone,
        # which "batch_mean" cannot read, and a run without the batch-shape rule would fail in eval
        # instead of training on the joined means as the campaign's did (exit 0).
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs
        correct = tf.equal(tf.argmax(logits, -1, output_type=tf.int32), batch[1])
        return {"loss": self.compute_loss(outputs, batch),
                "accuracy": tf.reduce_mean(tf.cast(correct, tf.float32))}

    def penalty(self, misuse, batch):
        """A gradient penalty computed the way `misuse` gets it wrong (0 for none)."""
        features, labels = batch
        critic = lambda x: mixloop.forward(self.model, self.policy, x, training=True)
        if misuse == "policy_string":
            return tf.reduce_sum(mixloop.forward(self.model, "mixed_float16", features, training=True))
        if misuse == "no_training":
            return tf.reduce_sum(mixloop.forward(self.model, self.policy, features))
        if misuse == "unrelated_input":
            return tf.reduce_sum(mixloop.input_gradients(lambda x: critic(features), features * 1.0))
        if misuse == "integer_inputs":
            return tf.reduce_sum(mixloop.input_gradients(critic, labels))
        if misuse == "dict_fn":
            return tf.reduce_sum(mixloop.input_gradients(lambda x: {"score": critic(x)}, features))
        if misuse == "zero_scale":
            return tf.reduce_sum(mixloop.input_gradients(critic, features, scale=0))
        return 0.0


def get_config(arg=None):
    config = tiny_experiment.get_config()
    config.trainer = "misuse_experiment.MisuseTrainer"
    config.model.misuse = ""  # What compute_loss gets wrong; see the module's docstring.
    config.precision.policy = "float32"  # No probes: the misuse is met at the step's first trace.
    config.jit_compile = False
    return config
