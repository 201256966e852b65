"""Loss scales: the exact dynamic-scale trajectory against a plain-Python reference, checkpointing,
argument checks, and `all_finite` on nested structures."""


import numpy as np
import pytest
import tensorflow as tf

from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale, all_finite


def reference_scales(flags, *, initial_scale, growth_interval, growth_factor, backoff_factor,
                     hysteresis, min_scale, max_scale):
    """The dynamic loss-scale algorithm in plain Python: (scale, good_steps, hysteresis_left) per flag."""
    scale, good_steps, hysteresis_left = initial_scale, 0, hysteresis
    trajectory = []
    for finite in flags:
        if finite:
            good_steps += 1
            if good_steps == growth_interval:
                scale = min(scale * growth_factor, max_scale)
                good_steps = 0
                hysteresis_left = hysteresis
        else:
            good_steps = 0
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:
                scale = max(scale * backoff_factor, min_scale)
        trajectory.append((scale, good_steps, hysteresis_left))
    return trajectory


def scripted_flags(seed):
    """400 finite/overflow flags: a calm phase that climbs to max_scale, a stormy one that falls to
    min_scale, then a mixed phase; the per-phase overflow probabilities make both bounds reachable."""
    rng = np.random.default_rng(seed)
    phases = [(120, 0.03), (80, 0.8), (200, 0.25)]
    return np.concatenate([rng.random(n) >= p for n, p in phases])


CONFIGS = {
    # Defaults of growth and back-off, short interval, every overflow backs off.
    "hysteresis_1": dict(initial_scale=2.0**4, growth_interval=3, growth_factor=2.0, backoff_factor=0.5,
                         hysteresis=1, min_scale=1.0, max_scale=2.0**7),
    # Tolerates one overflow between growths; non-power-of-two factors (3 * 2**k stays exact in float32).
    "hysteresis_2": dict(initial_scale=6.0, growth_interval=2, growth_factor=3.0, backoff_factor=0.5,
                         hysteresis=2, min_scale=0.75, max_scale=486.0),
}


def _state(loss_scale):
    return (float(loss_scale.scale), int(loss_scale.good_steps), int(loss_scale.hysteresis_left))


def _run_eager(loss_scale, flags):
    trajectory = []
    for finite in flags:
        loss_scale.update(tf.constant(finite))
        trajectory.append(_state(loss_scale))
    return trajectory


def _run_one_tf_function_call_per_update(loss_scale, flags):
    @tf.function
    def update(finite):
        loss_scale.update(finite)
        return loss_scale.scale, loss_scale.good_steps.read_value(), loss_scale.hysteresis_left.read_value()

    return [tuple(x.numpy().item() for x in update(tf.constant(finite))) for finite in flags]


def _run_in_a_compiled_loop(loss_scale, flags):
    @tf.function(jit_compile=True)
    def run(flags):
        def body(i, scales, good_steps, hysteresis_left):
            loss_scale.update(flags[i])
            return (i + 1, scales.write(i, loss_scale.scale), good_steps.write(i, loss_scale.good_steps),
                    hysteresis_left.write(i, loss_scale.hysteresis_left))

        n = tf.shape(flags)[0]
        arrays = [tf.TensorArray(tf.float32, size=n), tf.TensorArray(tf.int64, size=n),
                  tf.TensorArray(tf.int64, size=n)]
        _, *arrays = tf.while_loop(lambda i, *_: i < n, body, [0, *arrays])
        return [a.stack() for a in arrays]

    scales, good_steps, hysteresis_left = (a.numpy().tolist() for a in run(tf.constant(flags)))
    return list(zip(scales, good_steps, hysteresis_left))


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("run", [_run_eager, _run_one_tf_function_call_per_update, _run_in_a_compiled_loop],
                         ids=["eager", "tf_function", "jit_while_loop"])
def test_dynamic_trajectory_matches_reference(config_name, run):
    config = CONFIGS[config_name]
    flags = scripted_flags(seed=7)
    expected = reference_scales(flags, **config)
    expected_scales = [s for s, _, _ in expected]
    # The script must really exercise both bounds, back-offs and growths, or the test proves little.
    assert config["max_scale"] in expected_scales and config["min_scale"] in expected_scales
    assert np.sum(~flags) > 50 and np.sum(flags) > 200

    actual = run(DynamicLossScale(**config), flags)

    for step, (got, want) in enumerate(zip(actual, expected)):
        assert got == (np.float32(want[0]), want[1], want[2]), f"update {step} (finite={flags[step]})"
    assert len(actual) == len(expected)


def test_hysteresis_2_backs_off_only_at_the_second_overflow_since_growth():
    loss_scale = DynamicLossScale(initial_scale=8.0, growth_interval=2, hysteresis=2)
    scales = []
    for finite in [False, False, False, True, True, False, False]:
        loss_scale.update(finite)
        scales.append(float(loss_scale.scale))
    assert scales == [8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 2.0]


def test_dynamic_state_survives_checkpoint_into_a_fresh_object(tmp_path):
    config = CONFIGS["hysteresis_2"]
    flags = scripted_flags(seed=11)
    expected = reference_scales(flags, **config)
    loss_scale = DynamicLossScale(**config)
    _run_eager(loss_scale, flags[:57])
    saved_state = _state(loss_scale)
    assert saved_state == (np.float32(expected[56][0]), expected[56][1], expected[56][2])
    path = tf.train.Checkpoint(loss_scale=loss_scale).write(str(tmp_path / "ckpt"))
    assert {name for name, _ in tf.train.list_variables(path)} >= {
        "loss_scale/_scale/.ATTRIBUTES/VARIABLE_VALUE",
        "loss_scale/good_steps/.ATTRIBUTES/VARIABLE_VALUE",
        "loss_scale/hysteresis_left/.ATTRIBUTES/VARIABLE_VALUE",
    }

    _run_eager(loss_scale, flags[57:90])  # move away from the saved state
    assert _state(loss_scale) != saved_state
    tf.train.Checkpoint(loss_scale=loss_scale).read(path).assert_consumed()
    assert _state(loss_scale) == saved_state

    restored = DynamicLossScale(**config)
    tf.train.Checkpoint(loss_scale=restored).read(path).assert_consumed()
    assert _state(restored) == saved_state
    continued = _run_eager(restored, flags[57:])
    assert continued == [(np.float32(s), g, h) for s, g, h in expected[57:]]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(min_scale=8.0, max_scale=4.0), "max_scale"),
        (dict(max_scale=float("inf")), "max_scale"),
        (dict(initial_scale=2.0**30), "initial_scale"),
        (dict(initial_scale=0.5, min_scale=1.0), "initial_scale"),
        (dict(initial_scale=float("nan")), "initial_scale"),
    ],
)
def test_dynamic_rejects_bad_arguments_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        DynamicLossScale(**kwargs)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_static_rejects_non_positive_or_non_finite_values(value):
    with pytest.raises(ValueError, match="value"):
        StaticLossScale(value)


@pytest.mark.parametrize("loss_scale_fn, factor", [(NoLossScale, 1.0), (lambda: StaticLossScale(2.0**10), 2.0**10),
                                                   (lambda: DynamicLossScale(initial_scale=2.0**12), 2.0**12)],
                         ids=["none", "static", "dynamic"])
def test_scale_loss_and_unscale(loss_scale_fn, factor):
    loss_scale = loss_scale_fn()
    assert float(loss_scale.scale_loss(tf.constant(1.5))) == 1.5 * factor
    scaled_grads = {"w": tf.constant([3.0 * factor, -0.5 * factor], tf.float16), "b": None}
    grads = loss_scale.unscale(scaled_grads)
    assert grads["b"] is None
    assert grads["w"].dtype == tf.float32
    assert grads["w"].numpy().tolist() == [3.0, -0.5]


@pytest.mark.parametrize("loss_scale_fn", [NoLossScale, lambda: StaticLossScale(3.0)], ids=["none", "static"])
def test_fixed_scales_ignore_updates(loss_scale_fn):
    loss_scale = loss_scale_fn()
    before = float(loss_scale.scale)
    for finite in [False, True, False, False, True]:
        loss_scale.update(tf.constant(finite))
    assert float(loss_scale.scale) == before


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "tree, expected",
    [
        ({"a": tf.ones([2, 3]), "b": (tf.zeros([4], tf.float16), [tf.constant(1e30)])}, True),
        ({"a": tf.ones([2, 3]), "b": (tf.zeros([4], tf.float16), [tf.constant([1.0, _NAN])])}, False),
        ({"a": tf.constant([[0.0, _INF]]), "b": (tf.zeros([4]), [])}, False),
        ([tf.constant(-_INF, tf.bfloat16), tf.ones([1])], False),
        ([tf.ones([3]), None, (tf.constant([65504.0], tf.float16),)], True),
        ([tf.ones([3]), None, (tf.constant([65504.0], tf.float16) * 2,)], False),  # float16 overflow
        ([None], True),
    ],
    ids=["finite", "nan", "inf", "neg_inf_bf16", "none_leaf", "float16_overflow", "only_none"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_all_finite(tree, expected, compiled):
    check = tf.function(all_finite) if compiled else all_finite
    result = check(tree)
    assert result.dtype == tf.bool and result.shape == ()
    assert bool(result) is expected
