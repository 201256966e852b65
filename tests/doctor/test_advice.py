"""What the doctor advises (doctor/advice.py), on reports made by hand: the finest hot layers, why
each, and the float16 initial scale once some layers compute in float32."""

import ml_collections

from mixloop.doctor import advice
from mixloop.doctor.report import Advice, LayerReport, PrecisionReport, VariableReport
from mixloop.engine.policy import Policy


def layer(path, headroom=10.0, max_abs=1.0, creates=False, dtype="float16", grad=0.01):
    return LayerReport(path=path, compute_dtype=dtype, max_abs_input=max_abs, max_abs_output=max_abs,
                       headroom_bits=headroom, non_finite_outputs=4 if creates else 0,
                       creates_non_finite=creates, float32_non_finite_outputs=0,
                       max_abs_output_grad=grad, output_grad_zero_fraction=0.0)


def variable(path, max_abs, dtype="float16"):
    return VariableReport(path=path, dtype=dtype, num_values=10, max_abs=max_abs, min_abs=max_abs / 10,
                          zero_fraction=0.0, subnormal_fraction=0.0, overflow_fraction=0.0,
                          mixed_zero_fraction=0.0, absolute_error=0.0, relative_error=None,
                          histogram={0: 10})


def test_a_block_is_not_hot_for_its_sublayer_the_sublayer_is():
    block, inner, other = layer("block", 1.0), layer("block/inner", 1.0), layer("other", 2.0)
    assert advice.finest([block, inner, other]) == [inner, other]
    assert advice.is_under("block/inner/dense", ["block/inner"]) and not advice.is_under("blocks", ["block"])


def test_why_a_layer_is_kept_says_how_close_it_came_and_where():
    hot = layer("pool", headroom=-0.5, max_abs=92000.0, creates=True)
    line = advice.hot_layer_problem(hot, [hot, layer("pool/inner")])
    assert line == ("pool (float16): values up to 9.2e+04 exceed float16's largest finite value, "
                    "65504; it turned finite inputs into 4 inf or NaN outputs; in its own ops, not in "
                    "a sublayer (the smallest layer that holds them)")


def test_the_initial_scale_leaves_the_largest_gradient_left_in_float16_three_doublings_below_the_top():
    report = PrecisionReport(
        trainer="t", objective="model", objectives=["model"], policy="p", compute_dtype="float16",
        step=0, num_batches=1, num_micro_batches=1, loss_scale=2.0**15, comparison_scale=2.0**15,
        gradient_zero_fraction=0.0, gradient_subnormal_fraction=0.0, gradient_overflow_fraction=0.0,
        layers=[layer("hot", grad=512.0), layer("body", grad=1.0)],
        variables=[variable("hot/kernel", 512.0), variable("body/kernel", 1.0)],
        advice=Advice([], [], "", 0.0, None, None, 0.0, 0.0, True, {}))
    # 512 leaves 2**3 (65504 / 512 / 8 = 15.99, down to a power of two); without `hot`, 1: 2**12.
    assert advice.initial_scale_keeping(report, []) == 2.0**3
    assert advice.initial_scale_keeping(report, ["hot"]) == 2.0**12
    assert advice.largest_gradient(report.layers, report.variables) == 512.0


def test_advice_moves_the_hot_layer_and_gives_the_overrides_that_apply_it():
    precision = ml_collections.ConfigDict(dict(float32_layers="auto", loss_scale="dynamic",
                                               max_scale=2.0**24, min_scale=1.0))
    layers = [layer("hot", headroom=1.0, grad=512.0), layer("body", grad=1.0)]
    variables = [variable("hot/kernel", 512.0), variable("body/kernel", 1.0)]
    advised = advice.advise(layers, variables, [0.0, 0.0, 0.0], 2.0**15,
                            Policy.from_string("mixed_float16"), precision, "", [], [])
    assert advised.float32_layers == ["hot"] and advised.initial_scale == 2.0**12
    assert advised.overrides == {"precision.float32_layers": "hot", "precision.initial_scale": 2.0**12}
    assert advised.problems == ["hot (float16): values up to 1 come within 1.0 doublings of "
                                "float16's largest finite value, 65504"]
