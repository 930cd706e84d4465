"""The policy's optimizer part: update_rounding and optimizer_state_dtype, the presets, the jmp
grammar, the config round trip and the refusals (docs/memory.md)."""

import pickle

import numpy as np

import pytest

import mixedpolicy as mp


@pytest.mark.parametrize("name, rounding, state", [
    ("bfloat16_stochastic", "stochastic", "bfloat16"),
    ("bfloat16_stochastic_int8", "stochastic", "int8"),
    ("p=bf16,rounding=kahan", "kahan", "bfloat16"),
    ("p=f16,rounding=kahan", "kahan", "float16"),
    ("params=bfloat16,rounding=stochastic,state=float32", "stochastic", "float32"),
    ("p=bf16,state=8bit", "nearest", "int8"),
    ("mixed_bfloat16", "nearest", "float32"),  # what every optimizer does by itself
    ("bfloat16", "nearest", "bfloat16"),
])
def test_the_optimizer_part_in_every_spelling_round_trips(name, rounding, state):
    p = mp.Policy(name)
    assert (p.update_rounding, p.optimizer_state_dtype) == (rounding, state)
    assert mp.Policy(p.name) == p == mp.Policy.from_config(p.get_config()) == pickle.loads(pickle.dumps(p))
    assert p.updates_as_the_optimizer_does == (rounding == "nearest" and state == p.variable_dtype)
    assert mp.Policy(p) == p


def test_keywords_build_the_presets_and_other_parts_keep_them():
    p = mp.Policy("bfloat16", update_rounding="stochastic", optimizer_state_dtype="int8")
    assert p == mp.Policy("bfloat16_stochastic_int8") and p.name == "bfloat16_stochastic_int8"
    assert mp.Policy("bfloat16_stochastic", optimizer_state_dtype="int8") == p
    # a reduce dtype or an fp8 recipe: the jmp grammar says it all
    q = mp.Policy("bfloat16_stochastic", reduce_dtype="float32")
    assert q.name == "params=bfloat16,compute=bfloat16,output=bfloat16,reduce=float32,rounding=stochastic"
    assert mp.Policy(q.name) == q
    f8 = mp.Policy("p=bf16,c=bf16,float8=tensorwise,rounding=stochastic")
    assert f8.float8_recipe is not None and f8.source.update_rounding == "stochastic" and mp.Policy(f8.name) == f8
    assert mp.Policy.from_config({"name": "bfloat16"}).update_rounding == "nearest"  # older configs


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "mixed_bfloat16", "update_rounding": "stochastic"}, "float32 variables.*'bfloat16_stochastic'"),
    ({"name": "float32", "update_rounding": "kahan"}, "keep update_rounding='nearest'"),
    ({"name": "float16", "update_rounding": "stochastic"}, "update_rounding='kahan'"),
    ({"name": "bfloat16", "update_rounding": "up"}, "expected one of 'nearest', 'stochastic', 'kahan'"),
    ({"name": "bfloat16", "update_rounding": 1}, "update_rounding=1"),
    ({"name": "bfloat16", "optimizer_state_dtype": "float16"}, "'float32', 'bfloat16', 'int8'"),
    ({"name": "bfloat16", "optimizer_state_dtype": "int4"}, "optimizer_state_dtype"),
    ({"name": "p=bf16,rounding=stochastic,rounding=kahan"}, "sets 'rounding' twice"),
    ({"name": "rounding=stochastic"}, "float32 variables"),  # jmp: params default to float32
])
def test_impossible_combinations_are_refused_with_the_fix(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        mp.Policy(name, **kwargs)


def test_an_unknown_name_lists_the_presets():
    with pytest.raises(ValueError, match="bfloat16_stochastic_int8"):
        mp.Policy("bfloat16_sr")


def test_one_optimizer_rounds_one_way():
    optax = pytest.importorskip("optax")
    mixed = mp.PolicyMap("bfloat16_stochastic", {"head": "p=bf16,rounding=kahan"})
    with pytest.raises(ValueError, match=r"\('kahan', 'bfloat16'\), \('stochastic', 'bfloat16'\).*one way"):
        mp.LossScaleOptimizer(optax.sgd(0.1), policy=mixed)
    mp.LossScaleOptimizer(optax.sgd(0.1), policy="bfloat16")  # nothing asked of the optimizer


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_state_codes_are_the_nearest_map_entries_over_many_decades(signed):
    from mixedpolicy import quantized_state as q

    table = q.code_map(signed)
    assert table.shape == (256,) and table.max() == 1.0 and (table.min() == -1.0) == signed
    rng = np.random.default_rng(0)
    x = (rng.normal(size=64 * 256) * 10.0 ** rng.uniform(-9, 0, 64 * 256)).astype(np.float32)
    x = x if signed else np.abs(x)
    codes, absmax = q.quantize(np, x.reshape(128, 128), signed)
    assert codes.dtype == np.uint8 and codes.shape == (128, 128) and absmax.shape == (64,)
    normed = x.reshape(-1, 256) / absmax[:, None]
    usable = table[:255] if signed else table  # code 255 of the signed map is never written
    nearest = np.argmin(np.abs(normed[..., None] - usable), -1)
    assert np.array_equal(codes.reshape(-1, 256), nearest)
    back = q.dequantize(np, codes, absmax, signed)
    assert np.array_equal(np.abs(back).reshape(-1, 256).max(1), absmax)  # each block's largest exact
    assert q.quantizable((64, 64)) and not q.quantizable((63, 64)) and not q.quantizable((16, 16))
    # the table that finds the nearest entry relies on no bucket of 16 top bits holding two entries
    assert np.bincount(q._MAGNITUDES[signed].view(np.uint32) >> 16).max() == 1
