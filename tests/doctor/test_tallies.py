"""What the doctor's passes add up (doctor/tallies.py): a variable's gradient over micro-batches in its
16-bit dtype, its drift from float32, and a layer's range."""

import keras
import numpy as np
import pytest

from mixloop.doctor import passes
from mixloop.doctor.tallies import LayerTally, VariableTally


def test_a_variables_tally_counts_what_flushes_and_overflows_at_the_scale_and_its_drift():
    tally = VariableTally("dense/kernel", "float16", overwritten=False)
    grad = np.array([1e-12, 1e-3, 10.0, 0.0], np.float32)
    tally.add_float32(grad, grad * 1.0001, scale=2.0**12)  # 1e-12 * 4096 flushes; 10 * 4096 fits.
    tally.add_mixed(grad, np.array([0.0, 1e-3, 10.0, 0.0], np.float32))
    report = tally.report(eps=2.0**-10)
    assert report.num_values == 3 and report.max_abs == pytest.approx(10.0)
    assert report.zero_fraction == pytest.approx(1 / 3) and report.overflow_fraction == 0.0
    assert report.mixed_zero_fraction == pytest.approx(1 / 3)
    assert report.absolute_error == pytest.approx(1e-12)
    assert report.relative_error == pytest.approx(1e-13, rel=1e-3)  # Its noise is below eps.


def test_an_overwritten_variables_tally_counts_only_its_non_finite_new_values():
    tally = VariableTally("dense/scale", "float16", overwritten=True)
    tally.add_float32(np.array([3.0]), None, scale=1.0)
    tally.add_mixed(np.array([3.0, 1.0]), np.array([np.inf, 1.0]))
    report = tally.report(eps=2.0**-10)
    assert report.overwritten and report.overflow_fraction == 0.5 and report.histogram == {}


def test_a_layers_tally_keeps_its_range_and_whether_it_made_inf_from_finite_inputs():
    layer = keras.layers.Dense(2, dtype="mixed_float16")
    tally = LayerTally("dense", layer, float8=False)
    call = dict(num_inputs=1, max_abs_input=3.0, non_finite_inputs=0, max_abs_output=70000.0,
                non_finite_outputs=0, max_abs_output_grad=0.5,
                output_grad_counts=np.array([4, 1, 0, 0]))
    tally.add_float32([passes.CallStats(**call)])
    tally.add_mixed([passes.CallStats(**{**call, "non_finite_outputs": 2})], [], 1.0)
    report = tally.report()
    assert report.compute_dtype == "float16" and report.headroom_bits < 0
    assert report.creates_non_finite and report.non_finite_outputs == 2
    assert report.output_grad_zero_fraction == 0.25 and report.float8 is None
