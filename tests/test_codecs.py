"""Reduce dtypes: the Policy field, its grammar, and the 8-bit codec against ml_dtypes."""

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import mixedpolicy as mp
from mixedpolicy import codecs


def test_reduce_dtype_defaults_to_the_variable_dtype_and_is_spelled_every_way():
    assert mp.Policy("mixed_float16").reduce_dtype == "float32"
    assert mp.Policy("bfloat16").reduce_dtype == "bfloat16"
    p = mp.Policy("mixed_bfloat16", reduce_dtype="bf16")
    assert p == mp.Policy("p=f32,c=bf16,r=bf16") == mp.Policy("params=float32,compute=bfloat16,reduce=bfloat16")
    assert p.name == "params=float32,compute=bfloat16,output=bfloat16,reduce=bfloat16"
    assert p != mp.Policy("mixed_bfloat16") and mp.Policy(p.name) == p and mp.Policy(p) == p
    assert mp.Policy.from_config(p.get_config()) == p and p.get_config()["reduce_dtype"] == "bfloat16"
    # a config from before reduce_dtype existed still loads, as the default
    old = {"name": "mixed_float16", "compute_dtype": "float16", "variable_dtype": "float32", "output_dtype": "float16"}
    assert mp.Policy.from_config(old) == mp.Policy("mixed_float16")
    for spelling in ("float8_e5m2", "e5m2", "fp8_e5m2"):
        assert mp.Policy("float32", reduce_dtype=spelling).reduce_dtype == "float8_e5m2"
    assert mp.Policy("mixed_float16", reduce_dtype="e4m3").reduce_dtype == "float8_e4m3fn"
    # the reduce dtype follows a changed variable dtype unless it was set
    assert mp.Policy(mp.Policy("float32"), variable_dtype="bfloat16").reduce_dtype == "bfloat16"
    assert mp.Policy(p, variable_dtype="float64").reduce_dtype == "bfloat16"


def test_bad_reduce_dtypes_are_refused_with_what_to_write():
    with pytest.raises(ValueError, match="ambiguous.*'float8_e5m2'.*'float8_e4m3fn'"):
        mp.Policy("mixed_float16", reduce_dtype="fp8")
    with pytest.raises(ValueError, match="reduce_dtype='int8'.*not a dtype gradients can be reduced in"):
        mp.Policy("mixed_float16", reduce_dtype="int8")
    with pytest.raises(ValueError, match="sets 'reduce' twice"):
        mp.Policy("p=f32,r=bf16,reduce=f16")
    with pytest.raises(ValueError, match="'reduce' \\('r'\\)"):
        mp.Policy("p=f32,x=bf16")
    with pytest.raises(TypeError, match="reduce_dtype=3"):
        mp.Policy("float32", reduce_dtype=3)


def test_describe_and_policy_maps_carry_the_reduce_dtype_per_layer():
    m = mp.PolicyMap("mixed_bfloat16", {"head": mp.Policy("mixed_bfloat16", reduce_dtype="e5m2")})
    table = mp.describe(mp.apply_policy(lambda w, x: w * x, "mixed_bfloat16"))
    assert "reduce" in str(table).splitlines()[0] and table[0].reduce_dtype == "float32"
    assert m.resolve([mp.LayerInfo("", object), mp.LayerInfo("head", object)]).policy.reduce_dtype == "float8_e5m2"


def test_wire_bytes_are_4_2_1_plus_the_scale():
    n = 1 << 12
    f32, bf16, fp8 = (codecs.wire_bytes(n, d) for d in ("float32", "bfloat16", "float8_e5m2"))
    assert (f32, bf16, fp8) == (4 * n, 2 * n, n + codecs.SCALE_BYTES)
    with pytest.raises(ValueError, match="reduce_dtype='int8'"):
        codecs.wire_bytes(n, "int8")


@pytest.mark.parametrize("call, error, says", [
    (lambda: codecs.is_float8(np.ones(3)), TypeError, "reduce_dtype=array"),
    (lambda: codecs.table_bits("table-3"), ValueError, "reduce_dtype='table-3'.*'table-4'"),
    (lambda: codecs.table_quantiles(None), TypeError, "bits=None of type NoneType; expected 1, 2, 4 or 8"),
    (lambda: codecs.table_quantiles(3), ValueError, "bits=3 of type int"),
    (lambda: codecs.encode_table(np.ones(4), True), TypeError, "bits=True"),
    (lambda: codecs.pack(np.zeros(4, np.uint8), 16), ValueError, "bits=16"),
    (lambda: codecs.float8_scale_exponent(1.0, "bfloat16"), ValueError, "'float8_e5m2', 'float8_e4m3fn'"),
])
def test_the_reference_codecs_refuse_what_names_no_codec(call, error, says):
    with pytest.raises(error, match=says):
        call()
    assert codecs.is_float8("float8_e5m2") and not codecs.is_float8("float32") and codecs.table_bits("table-4") == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-2.0**127, 2.0**127, allow_nan=False, width=32), min_size=1, max_size=64),
       st.sampled_from(["float8_e5m2", "float8_e4m3fn"]))
def test_float8_round_trip_is_within_the_formats_step_of_the_largest_value(values, fmt):
    import ml_dtypes

    x = np.asarray(values, np.float32)
    q, scale = codecs.encode_float8(x, fmt)
    assert q.dtype == np.dtype(getattr(ml_dtypes, fmt)) and np.isfinite(scale)
    back = codecs.decode_float8(q, scale)
    amax = float(np.max(np.abs(x)))
    assert np.all(np.isfinite(back))
    if amax == 0:
        assert np.all(back == 0)
        return
    # the scale puts the largest value in the format's top binade (tiny tensors: the largest scale)
    assert codecs.FLOAT8_MAX[fmt] / 2 < amax * float(scale) <= codecs.FLOAT8_MAX[fmt] or float(scale) == 2.0**126
    eps = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).eps)
    tiny = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).smallest_subnormal) / float(scale)
    # each value within half a step of its binade, or the subnormal step, of the format
    assert np.all(np.abs(back - x) <= np.abs(x) * eps / 2 * 1.0001 + tiny)


def test_what_no_8_bit_scale_can_carry_arrives_non_finite_never_silently_wrong():
    # above about 2.98e38 no power of two brings an 8-bit maximum within float32: such a
    # gradient arrives as inf, so a LossScaleOptimizer skips the step on every replica
    for fmt in ("float8_e5m2", "float8_e4m3fn"):
        q, scale = codecs.encode_float8(np.asarray([3.2e38, 1.0], np.float32), fmt)
        back = codecs.decode_float8(q, scale)
        with np.errstate(over="ignore"):
            assert not np.all(np.isfinite(codecs.decode_float8(q, scale))) or np.allclose(back, [3.2e38, 0], rtol=0.07)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=300),
       st.sampled_from([1, 2, 4, 8]))
@example([999507.0, 999510.0], 8)  # a float32 midpoint of two entries rounded onto a value
def test_table_codec_rounds_to_the_nearest_table_entry_and_keeps_signs(values, bits):
    x = np.asarray(values, np.float32)
    packed, table = codecs.encode_table(x, bits)
    assert packed.dtype == np.uint8 and table.dtype == np.float32 and table.size == 2 ** (bits - 1)
    assert packed.nbytes + table.nbytes == codecs.wire_bytes(x.size, f"table-{bits}")  # exact bytes
    back = codecs.decode_table(packed, table, bits, x.size)
    np.testing.assert_allclose(table, np.percentile(np.abs(x), codecs.table_quantiles(bits)), rtol=1e-6, atol=1e-37)
    # each |value| became the nearest table entry (ties either way), and kept its sign
    nearest = np.min(np.abs(np.abs(x)[:, None] - table[None, :]), axis=1)
    np.testing.assert_allclose(np.abs(np.abs(back) - np.abs(x)), nearest, rtol=1e-5, atol=1e-6)
    assert np.all(np.signbit(back) == np.signbit(x))
    # within the table's largest gap of every value up to its top entry
    gaps = np.diff(np.concatenate([[0.0], table]))
    inside = np.abs(x) <= table[-1]
    assert np.all(np.abs(back - x)[inside] <= gaps.max() / 2 * 1.0001 + table[0] + 1e-6)


def test_table_codec_zeros_stay_zero_and_a_non_finite_tensor_arrives_nan():
    for bits in (1, 2, 4, 8):
        zeros = np.zeros(17, np.float32)
        assert np.all(codecs.decode_table(*codecs.encode_table(zeros, bits), bits, 17) == 0)
        bad = np.asarray([1.0, np.inf, -2.0], np.float32)
        assert np.all(np.isnan(codecs.decode_table(*codecs.encode_table(bad, bits), bits, 3)))
    assert mp.Policy("float32", reduce_dtype="Table-1").reduce_dtype == "table-1"
    with pytest.raises(ValueError, match="1, 2, 4 or 8 bits"):
        mp.Policy("float32", reduce_dtype="table-3")


def _namespace(name: str):
    """The array namespace a backend hands the codec kernels: numpy, jax.numpy, or torch's own."""
    import importlib

    if name == "torch":
        return importlib.import_module("mixedpolicy.backends.torch.arrays").ARRAY_NAMESPACE
    return importlib.import_module(name)


@pytest.mark.parametrize("xp_name", ["numpy", "torch", "jax.numpy"])
@pytest.mark.parametrize("fmt", ["float8_e5m2", "float8_e4m3fn"])
def test_the_on_device_float8_scale_is_the_reference_power_of_two(xp_name, fmt):
    """DDP's hook and JAX's all_reduce share one scale kernel over the array namespace; it
    gives the reference exponent's scale for every magnitude, zeros and non-finite ones."""
    from conftest import require_module

    require_module(xp_name.split(".")[0])
    xp = _namespace(xp_name)
    # (no amax whose ratio to the format's maximum is a power of two: a log2 there may land a
    # rounding below the integer on another CPU's vector math, a scale half as large, still valid)
    for amax in [0.0, 1e-30, 1e-3, 0.7, 1.0, 440.0, 5e4, 3e38, float("inf"), float("nan")]:
        got = xp.asarray(codecs.float8_scale(xp, xp.asarray(amax, dtype=xp.float32), fmt))
        want = 2.0 ** codecs.float8_scale_exponent(amax, fmt)
        assert float(got) == np.float32(want), (xp_name, amax)


@pytest.mark.parametrize("xp_name", ["torch", "jax.numpy"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_the_table_kernels_are_the_references_bytes_on_each_array_namespace(xp_name, bits):
    """DDP's hook and JAX's all_reduce encode, pack, unpack and decode table-N with the kernels
    the numpy reference uses: the same bytes and the same values from the same table."""
    from conftest import require_module

    require_module(xp_name.split(".")[0])
    xp = _namespace(xp_name)
    x = np.random.default_rng(bits).normal(size=37).astype(np.float32)  # not a multiple of 8/N
    x[3] = 0.0
    packed, table = codecs.encode_table(x, bits)
    flat, table_x = xp.asarray(x), xp.asarray(table)
    codes, _ = codecs.table_codes(xp, flat, table_x, bits)
    got_packed = codecs.pack_codes(xp, codes, bits)
    np.testing.assert_array_equal(np.asarray(got_packed), packed)
    got_codes = codecs.unpack_codes(xp, got_packed, bits, x.size)
    np.testing.assert_array_equal(np.asarray(got_codes), codecs.unpack(packed, bits, x.size))
    np.testing.assert_array_equal(np.asarray(codecs.table_values(xp, got_codes, table_x, bits)),
                                  codecs.decode_table(packed, table, bits, x.size))
