"""PolicyMap: exact path > glob > class, built-in rules, inheritance, ambiguity errors."""

import warnings

import pytest

import mixedpolicy as mp
from mixedpolicy import LayerInfo, PolicyMap


class Layer: ...
class Dense(Layer): ...
class Norm(Layer): ...
class LayerNorm(Norm): ...
class Block(Layer): ...
class Mixin: ...
class Both(Dense, Mixin): ...


def chain(*specs):
    """chain(("encoder", Block), ("encoder.norm", LayerNorm, "normalization"))"""
    return [LayerInfo("", Layer)] + [LayerInfo(*spec) for spec in specs]


def resolve(m, *specs):
    return m.resolve(chain(*specs))


def test_default_then_global():
    assert resolve(PolicyMap("mixed_float16"), ("fc", Dense)) == (mp.Policy("mixed_float16"), "map default")
    mp.set_global_policy("mixed_bfloat16")
    assert resolve(PolicyMap(), ("fc", Dense)) == (mp.Policy("mixed_bfloat16"), "global policy")


def test_exact_beats_glob_beats_class():
    m = PolicyMap("mixed_bfloat16", {
        Dense: "float16", "enc.*": "bfloat16", "enc.fc": "float64"})
    assert resolve(m, ("enc", Block), ("enc.fc", Dense)).policy == mp.Policy("float64")
    assert resolve(m, ("enc", Block), ("enc.fc2", Dense)).policy == mp.Policy("bfloat16")
    assert resolve(m, ("dec", Block), ("dec.fc", Dense)).policy == mp.Policy("float16")


def test_more_literal_glob_wins_and_sources_name_the_key():
    m = PolicyMap("mixed_bfloat16", {"enc.*": "bfloat16", "enc.*.norm": "float32"})
    r = resolve(m, ("enc", Block), ("enc.0", Block), ("enc.0.norm", Norm))
    assert r == (mp.Policy("float32"), "map key 'enc.*.norm'")


def test_nearest_class_in_mro_wins():
    m = PolicyMap("float32", {Layer: "bfloat16", Norm: "float16"})
    assert resolve(m, ("n", LayerNorm)).policy == mp.Policy("float16")
    assert "Norm" in resolve(m, ("n", LayerNorm)).source


def test_ambiguous_globs_name_both_keys():
    # both globs have four literal characters: neither is more specific
    m = PolicyMap("float32", {"enc.*": "bfloat16", "*.fc2": "float16"})
    with pytest.raises(ValueError, match=r"Ambiguous PolicyMap for layer 'enc.fc2'.*"
                                         r"'enc.\*' \(bfloat16\) and '\*.fc2' \(float16\)"):
        resolve(m, ("enc", Block), ("enc.fc2", Dense))


def test_multiple_inheritance_follows_the_mro():
    m = PolicyMap("float32", {Mixin: "float16", Dense: "bfloat16"})
    assert resolve(m, ("x", Both)).policy == mp.Policy("bfloat16")  # Both -> Dense -> Layer -> Mixin


def test_ties_with_the_same_policy_are_not_ambiguous():
    m = PolicyMap("float32", {"enc.*": "bfloat16", "*.fc": "bfloat16"})
    assert resolve(m, ("enc.fc", Dense)).policy == mp.Policy("bfloat16")


def test_an_override_on_a_block_covers_its_children():
    m = PolicyMap("mixed_bfloat16", {"decoder": "float32"})
    r = resolve(m, ("decoder", Block), ("decoder.0", Block), ("decoder.0.fc", Dense))
    assert r == (mp.Policy("float32"), "map key 'decoder' (inherited from 'decoder')")


def test_builtin_rule_keeps_norm_statistics_in_float32():
    m = PolicyMap("mixed_float16")
    r = resolve(m, ("norm", LayerNorm, "normalization"))
    assert r.source == "built-in rule: normalization"
    assert (r.policy.variable_dtype, r.policy.compute_dtype, r.policy.output_dtype) == \
        ("float32", "float32", "float16")
    loss = resolve(m, ("loss", Layer, "loss")).policy
    assert (loss.compute_dtype, loss.output_dtype) == ("float32", "float32")


def test_builtin_rule_applies_inside_an_overridden_block_but_not_over_own_key():
    m = PolicyMap("float32", {"enc": "bfloat16", "enc.norm2": "bfloat16"})
    assert resolve(m, ("enc", Block), ("enc.norm", Norm, "normalization")).policy.compute_dtype == "float32"
    assert resolve(m, ("enc", Block), ("enc.norm2", Norm, "normalization")).policy.compute_dtype == "bfloat16"


def test_builtin_rules_can_be_disabled_and_do_nothing_in_full_precision():
    assert resolve(PolicyMap("mixed_float16", builtin_rules=False),
                   ("n", Norm, "normalization")).policy == mp.Policy("mixed_float16")
    assert resolve(PolicyMap("float32"), ("n", Norm, "normalization")).source == "map default"


def test_value_semantics():
    a = PolicyMap("mixed_float16", {"x": "float32", Norm: "float32"})
    b = PolicyMap("16-mixed", {"x": mp.Policy("full"), Norm: "f32"})
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize("overrides, exc, message", [
    ({3: "float32"}, TypeError, "override key 3 of type int.*layer path.*glob.*layer class"),
    ({"x": "banana"}, ValueError, r"In overrides\['x'\]: Received policy name 'banana'"),
    ({"x": 1.5}, TypeError, r"overrides\['x'\]=1.5"),
    (["x"], TypeError, "overrides of type list"),
])
def test_bad_overrides(overrides, exc, message):
    with pytest.raises(exc, match=message):
        PolicyMap("float32", overrides)


def test_bad_default_and_flag():
    with pytest.raises(ValueError, match="mixed_int8"):
        PolicyMap("mixed_int8")
    with pytest.raises(TypeError, match="builtin_rules"):
        PolicyMap("float32", builtin_rules="yes")


def test_unmatched_keys_warn_with_nearest_paths():
    layers = chain(("encoder", Block), ("encoder.norm", Norm), ("decoder", Block))
    m = PolicyMap("float32", {"encodr.norm": "bfloat16", "enc*": "bfloat16", LayerNorm: "float16"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.warn_unmatched(layers)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "'encodr.norm' matches no layer path" in messages[0] and "'encoder.norm'" in messages[0]
    assert "LayerNorm" in messages[1] and "no layer of that class" in messages[1]
    with pytest.warns(UserWarning, match=r"'Norm' is the name of a layer class \(layers \['encoder.norm'\]\).*a "
                                         r"string key is a path.*make the class itself the key \(.*\.Norm\)"):
        PolicyMap("float32", {"Norm": "bfloat16"}).warn_unmatched(layers)
    with warnings.catch_warnings(record=True) as caught:  # a generator of layers, as adapters pass them
        warnings.simplefilter("always")
        m.warn_unmatched(layer for layer in layers)
    assert len(caught) == 2
    for bad in ("encoder", None, [("encoder", Block)]):
        with pytest.raises(TypeError, match="expected a list of LayerInfo"):
            m.warn_unmatched(bad)


def test_apply_policy_rejects_map_plus_overrides():
    with pytest.raises(TypeError, match="put the overrides into the PolicyMap"):
        mp.apply_policy(lambda x: x, PolicyMap("float32"), {"a": "float16"})


def test_norm_rule_keeps_norm_variables_in_float32_under_pure_half():
    r = resolve(PolicyMap("bfloat16"), ("norm", Norm, "normalization"))
    assert (r.policy.variable_dtype, r.policy.compute_dtype, r.policy.output_dtype) == \
        ("float32", "float32", "bfloat16")


@pytest.mark.parametrize("kind, halves", [("keep_float32", ("bfloat16", "float16")),
                                         ("keep_float32_over_float16", ("float16",))])
def test_layers_a_model_keeps_in_float32_keep_float32_weights_where_the_policys_are_half(kind, halves):
    for policy in ("bfloat16", "float16", "mixed_bfloat16", "mixed_float16", "float32"):
        r = resolve(PolicyMap(policy), ("router", Block, kind))
        if policy in halves:
            assert (r.policy.variable_dtype, r.policy.compute_dtype, r.policy.output_dtype) == ("float32",) * 3
            assert (r.source, r.origin) == (f"built-in rule: {kind}", "rule")
        else:  # float32 weights already (or another half the model stores such layers in)
            assert r.policy == mp.Policy(policy), (kind, policy)
    assert resolve(PolicyMap("float16", builtin_rules=False), ("router", Block, kind)).policy == mp.Policy("float16")
    assert resolve(PolicyMap("float16", {"router": "float16"}), ("router", Block, kind)).origin == "key"
    fp8 = mp.Policy("float8_from_mixed_bfloat16")  # out of fp8, in its source precision
    assert resolve(PolicyMap(fp8), ("router", Block, kind)).policy == mp.Policy("mixed_bfloat16")


def test_blank_key_is_a_value_error():
    with pytest.raises(ValueError, match="blank override key"):
        PolicyMap("float32", {"  ": "float16"})


def test_a_resolution_carries_its_origin_as_a_value_and_stays_a_pair():
    from mixedpolicy import LayerInfo, PolicyMap

    m = PolicyMap("mixed_bfloat16", {"head": "float32", "enc": "float16"})
    chain = [LayerInfo("", object), LayerInfo("enc", object)]
    origins = [m.resolve([LayerInfo("", object), LayerInfo("head", object)]).origin,
               m.resolve(chain + [LayerInfo("enc.norm", object, "normalization")]).origin,
               m.resolve(chain + [LayerInfo("enc.fc", object)]).origin,
               m.resolve([LayerInfo("", object)]).origin,
               PolicyMap().resolve([LayerInfo("", object)]).origin]
    assert origins == ["key", "rule", "inherited", "default", "global"]
    r = m.resolve([LayerInfo("", object), LayerInfo("head", object)])
    assert r == (r.policy, r.source) and len(r) == 2


def test_resolve_takes_a_list_of_layer_infos_and_says_so():
    m = PolicyMap("mixed_float16")
    for bad in ("encoder", 1, None, ["encoder"]):
        with pytest.raises(TypeError, match="expected a list of LayerInfo from the root model"):
            m.resolve(bad)
    with pytest.raises(ValueError, match="empty chain"):
        m.resolve([])
    assert m.resolve((LayerInfo("", object),)).policy == mp.Policy("mixed_float16")
