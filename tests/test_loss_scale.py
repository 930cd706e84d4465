"""Loss scales: the state machine, its bounds, purity, and the same results on every backend."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mixedpolicy as mp
from mixedpolicy import DynamicLossScale, NoLossScale, StaticLossScale


def reference(flags, scale, steps, growth, backoff, lo, hi):
    """The algorithm of the docstring, in plain Python floats."""
    counter, out = 0, []
    for finite in flags:
        if finite:
            counter += 1
            if counter == steps:
                counter, scale = 0, min(scale * growth, hi)
        else:
            counter, scale = 0, max(scale * backoff, lo)
        out.append((scale, counter))
    return out


def test_defaults_are_keras():
    s = DynamicLossScale()
    assert float(s.loss_scale) == 2.0**15 and int(s.counter) == 0
    assert (s.dynamic_growth_steps, s.growth_factor, s.backoff_factor, s.min_scale, s.max_scale) == \
        (2000, 2.0, 0.5, 1.0, 2.0**24)
    assert s.loss_scale.dtype == np.float32 and s.counter.dtype == np.int32


def test_adjust_is_pure():
    s = DynamicLossScale(loss_scale=8.0, dynamic_growth_steps=1)
    t = s.adjust(True)
    assert float(s.loss_scale) == 8.0 and float(t.loss_scale) == 16.0
    assert s == DynamicLossScale(loss_scale=8.0, dynamic_growth_steps=1)


def test_value_semantics_and_replace():
    a, b = DynamicLossScale(loss_scale=4.0), DynamicLossScale(loss_scale=4.0)
    assert a == b and hash(a) == hash(b)
    assert a != a.adjust(False)
    c = dataclasses.replace(a, min_scale=0.25)
    assert c.min_scale == 0.25 and a.min_scale == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.loss_scale = 2.0
    assert StaticLossScale(2.0) == StaticLossScale(2.0) != StaticLossScale(4.0)
    assert NoLossScale() == NoLossScale() and hash(NoLossScale()) == hash(NoLossScale())


def test_a_long_run_of_overflows_stops_at_the_floor():
    s = DynamicLossScale()
    for _ in range(200):
        s = s.adjust(False)
    assert float(s.loss_scale) == 1.0
    s = DynamicLossScale(min_scale=2.0**-4)  # a floor below 1 is allowed
    for _ in range(200):
        s = s.adjust(False)
    assert float(s.loss_scale) == 2.0**-4


def test_growth_stops_at_the_ceiling():
    s = DynamicLossScale(loss_scale=2.0**23, dynamic_growth_steps=1)
    for _ in range(10):
        s = s.adjust(True)
    assert float(s.loss_scale) == 2.0**24


def test_scale_and_unscale():
    s = DynamicLossScale(loss_scale=1024.0)
    loss = s.scale(np.float16(0.5))
    assert loss.dtype == np.float32 and float(loss) == 512.0  # the scaled loss is float32
    grads = {"w": np.full(3, 2048.0, np.float16), "b": np.float32(1024.0), "step": np.int32(7)}
    out = s.unscale(grads)
    assert out["w"].dtype == np.float16 and np.all(out["w"] == 2.0)
    assert out["b"].dtype == np.float32 and float(out["b"]) == 1.0
    assert out["step"] == 7 and out["step"].dtype == np.int32  # integers are never touched
    assert NoLossScale().unscale(grads) is grads


def test_static_and_none_never_change():
    for s in (StaticLossScale(128.0), NoLossScale()):
        assert s.adjust(False) is s and s.adjust(True) is s
    assert float(NoLossScale().loss_scale) == 1.0


@pytest.mark.parametrize("kwargs, message", [
    ({"loss_scale": 0.0}, "loss_scale=0.0; expected a finite number > 0"),
    ({"loss_scale": -1.0}, "loss_scale=-1.0"),
    ({"loss_scale": float("inf")}, "loss_scale=inf"),
    ({"loss_scale": 1e39}, "larger than float32"),
    ({"loss_scale": 2.0**30, "max_scale": 2.0**24}, r"outside \[min_scale, max_scale\]"),  # bounds given
    ({"loss_scale": 0.5, "min_scale": 1.0}, r"outside \[min_scale, max_scale\]"),
    ({"dynamic_growth_steps": 0}, "dynamic_growth_steps=0; expected a whole number >= 1"),
    ({"dynamic_growth_steps": 2.5}, "dynamic_growth_steps=2.5"),
    ({"growth_factor": 1.0}, "growth_factor=1.0; expected a number > 1"),
    ({"growth_factor": 0.5}, "growth_factor=0.5"),
    ({"backoff_factor": 1.0}, r"backoff_factor=1.0; expected a number in \(0, 1\)"),
    ({"backoff_factor": 0.0}, "backoff_factor=0.0"),
    ({"min_scale": 0.0}, "min_scale=0.0"),
    ({"min_scale": 8.0, "max_scale": 4.0, "loss_scale": 4.0}, "min_scale=8.0 > max_scale=4.0"),
    ({"counter": -1}, "counter=-1"),
])
def test_bad_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScale(**kwargs)


def test_default_bounds_hold_an_initial_scale_given_outside_them():
    # GradScaler and Keras start anywhere (torch's own test starts at 1e38): a bound left to its
    # default widens to the initial scale, where a bound given is kept (and checked)
    high, low = DynamicLossScale(loss_scale=1e38), DynamicLossScale(loss_scale=0.25)
    assert (high.min_scale, high.max_scale) == (1.0, float(np.float32(1e38)))
    assert (low.min_scale, low.max_scale) == (0.25, 2.0**24)
    assert float(high.adjust(True).adjust(False).loss_scale) == float(np.float32(1e38)) / 2
    assert DynamicLossScale(loss_scale=2.0**30, period=10).max_scale > 1e38  # jmp's: float32's ceiling


def test_bad_types_are_rejected():
    with pytest.raises(TypeError, match="loss_scale='big'.*positive number"):
        DynamicLossScale(loss_scale="big")
    with pytest.raises(TypeError, match="loss_scale=True"):
        StaticLossScale(True)
    with pytest.raises(ValueError, match="loss_scale=0"):
        StaticLossScale(0)


def _on(backend, state):
    """The same state with arrays of `backend`."""
    return state.with_state(backend.asarray(float(state.loss_scale), "float32"),
                            backend.asarray(int(state.counter), "int32"))


FLAGS = [False, True, True, True, False, False, True, True, True, True, True, False] + [True] * 7


def test_same_trajectory_on_every_backend(backend):
    ref = DynamicLossScale(loss_scale=2.0**15, dynamic_growth_steps=3, min_scale=2.0**13)
    s = _on(backend, ref)
    for flag in FLAGS:
        ref = ref.adjust(flag)
        s = s.adjust(backend.asarray(flag, "bool"))
        assert backend.is_array(s.loss_scale)
        assert backend.floating_dtype(s.loss_scale) == "float32"
        assert float(np.asarray(s.loss_scale)) == float(ref.loss_scale)
        assert int(np.asarray(s.counter)) == int(ref.counter)



def test_a_state_made_on_the_host_steps_on_the_flags_backend(backend):
    """jmp's loop: `ls = ls.adjust(all_finite(grads))` from the state the constructor made (numpy
    arrays). A torch flag failed (torch.zeros_like of a numpy array); each backend's flag now
    steps the state into its own arrays, on the same trajectory."""
    ref = s = DynamicLossScale(loss_scale=2.0**15, dynamic_growth_steps=3, min_scale=2.0**13)
    for flag in FLAGS:
        grads = [backend.asarray([1.0, 0.0 if flag else np.inf], "float32")]
        ref, s = ref.adjust(flag), s.adjust(backend.all_finite(grads))
        assert float(np.asarray(s.loss_scale)) == float(ref.loss_scale)
        assert int(np.asarray(s.counter)) == int(ref.counter)
    assert backend.is_array(s.loss_scale)

def test_unscale_and_finiteness_on_every_backend(backend):
    s = _on(backend, DynamicLossScale(loss_scale=256.0))
    grads = [backend.asarray(np.full(4, 512.0), d) for d in ("float16", "bfloat16", "float32")]
    out = s.unscale(grads)
    for g, o in zip(grads, out):
        assert backend.floating_dtype(o) == backend.floating_dtype(g)
        assert np.all(np.asarray(backend.cast(o, "float32")) == 2.0)
    assert bool(np.asarray(backend.all_finite(out)))
    bad = out + [backend.asarray([1.0, np.inf], "float16")]
    assert not bool(np.asarray(backend.all_finite(bad)))
    assert not bool(np.asarray(backend.all_finite([backend.asarray([np.nan], "bfloat16")])))
    assert bool(np.asarray(backend.all_finite([backend.asarray([1, 2], "int32")])))


def _complex(backend, real, imag):
    """A complex64 array of `backend` with these parts (either may be inf or NaN)."""
    z = np.empty(len(real), np.complex64)
    z.real, z.imag = real, imag
    if backend.name == "torch":
        import torch
        return torch.from_numpy(z)
    if backend.name == "jax":
        import jax.numpy as jnp
        return jnp.asarray(z)
    if backend.name == "tensorflow":
        import tensorflow as tf
        return tf.constant(z)
    return z


def test_complex_gradients_are_unscaled_and_checked_as_their_two_parts(backend):
    """A complex parameter's gradient (an S4 layer's, a Fourier filter's) was passed through
    unscaled and unchecked: a mixed_float16 step moved it 2**15 times too far, and an inf in it
    went into the update. Each part is now divided and checked, as torch's own kernels would."""
    s = _on(backend, DynamicLossScale(loss_scale=256.0))
    g = _complex(backend, [512.0, -256.0], [256.0, 0.0])
    out = s.unscale([g])[0]
    real, imag, _ = backend.complex_parts(out)
    assert "complex64" in str(out.dtype)
    assert np.asarray(real).tolist() == [2.0, -1.0] and np.asarray(imag).tolist() == [1.0, 0.0]
    assert bool(np.asarray(backend.all_finite([g])))
    for bad in ([1.0, np.inf], [np.nan, 0.0]):
        for parts in ((bad, [0.0, 0.0]), ([0.0, 0.0], bad)):
            z = _complex(backend, *parts)
            assert not bool(np.asarray(backend.all_finite([g, z]))), parts
    assert s.unscale([1j * 512.0]) == [2j] and not bool(np.asarray(mp.all_finite([complex(1.0, np.inf)])))
    if backend.name == "torch":  # a lazily conjugated gradient (x.conj()) is read too
        assert not bool(mp.all_finite([_complex(backend, [1.0, np.inf], [0.0, 0.0]).conj()]))


settings.register_profile("mixedpolicy", deadline=None, max_examples=150)
settings.load_profile("mixedpolicy")


@given(flags=st.lists(st.booleans(), max_size=120),
       steps=st.integers(1, 6),
       log_scale=st.integers(-4, 24),
       log_lo=st.integers(-8, 4),
       log_hi=st.integers(4, 26),
       growth=st.sampled_from([1.5, 2.0, 4.0]),
       backoff=st.sampled_from([0.25, 0.5, 0.9]))
def test_state_machine_properties(flags, steps, log_scale, log_lo, log_hi, growth, backoff):
    lo, hi = 2.0**log_lo, 2.0**log_hi
    start = min(max(2.0**log_scale, lo), hi)
    s = DynamicLossScale(loss_scale=start, dynamic_growth_steps=steps, growth_factor=growth,
                         backoff_factor=backoff, min_scale=lo, max_scale=hi)
    expected = reference(flags, np.float32(start), steps, np.float32(growth), np.float32(backoff),
                         np.float32(lo), np.float32(hi))
    finite_run = 0
    for flag, (ref_scale, ref_counter) in zip(flags, expected):
        before = float(s.loss_scale)
        s = s.adjust(flag)
        scale = float(s.loss_scale)
        assert lo <= scale <= hi and 0 < scale < np.inf  # bounded, never 0 or inf
        assert scale == float(ref_scale) and int(s.counter) == ref_counter
        finite_run = finite_run + 1 if flag else 0
        if not flag:  # every overflow backs off (down to the floor)
            assert scale == max(before * backoff, lo) or np.isclose(scale, max(before * backoff, lo))
            assert int(s.counter) == 0
        elif scale > before:  # growth only after a full run of finite steps
            assert finite_run % steps == 0 and finite_run >= steps
        else:
            assert scale == before or before == hi or scale == hi
