"""The doctor's report types (doctor/report.py): a dtype's range in doublings, what flushes to zero,
and the report written as strict JSON."""

import json
import math

import pytest
import tensorflow as tf

from mixloop.doctor.report import DtypeRange, VariableReport, sum_histograms


def test_float16_range_in_doublings():
    float16 = DtypeRange.of(tf.float16)
    assert float16.max_finite == 65504.0 and float16.eps == 2.0**-10
    assert float16.headroom_bits(65504.0 / 8) == pytest.approx(3.0)
    assert float16.headroom_bits(0.0) == math.inf and float16.headroom_bits(math.inf) == -math.inf
    # The largest 2**k keeping a gradient of 1.0 three doublings below 65504: 2**12.
    assert float16.safe_log2_scale(1.0, 3) == 12


def test_the_zero_fraction_counts_the_bins_below_half_the_smallest_subnormal():
    float16 = DtypeRange.of(tf.float16)  # Smallest subnormal 2**-24: [2**-26, 2**-25) flushes.
    histogram = {-26: 3, -25: 1, 0: 4}
    assert float16.zero_fraction(histogram) == 3 / 8
    assert float16.zero_fraction(histogram, log2_scale=1) == 0.0
    assert DtypeRange.of(tf.bfloat16).zero_fraction(histogram) == 0.0  # bfloat16 holds them.


def variable(path, histogram):
    return VariableReport(path=path, dtype="float16", num_values=sum(histogram.values()), max_abs=1.0,
                          min_abs=0.1, zero_fraction=0.0, subnormal_fraction=0.0,
                          overflow_fraction=0.0, mixed_zero_fraction=0.0, absolute_error=0.0,
                          relative_error=None, histogram=histogram)


def test_histograms_sum_by_bin():
    assert sum_histograms([variable("a", {-3: 2, 0: 1}), variable("b", {0: 4})]) == {-3: 2, 0: 5}


def test_strict_json_writes_non_finite_numbers_as_strings(tmp_path):
    from mixloop import files
    path = files.write_json(str(tmp_path / "sub" / "report.json"),
                            {"inf": math.inf, "nan": [math.nan], 3: -math.inf})
    assert json.loads(open(path).read()) == {"inf": "inf", "nan": ["nan"], "3": "-inf"}
