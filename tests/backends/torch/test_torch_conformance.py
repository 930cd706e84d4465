"""Regressions from the conformance review, torch models: copies, pickles, restores, attention."""

import copy
import io
import warnings

import pytest

from conftest import require_module

torch = require_module("torch")

import mixedpolicy as mp  # noqa: E402


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_a_deep_copy_computes_with_its_own_weights():
    model = mp.apply_policy(_mlp(), "mixed_bfloat16", {"2": "float32"})
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    x = torch.ones(2, 4)
    assert torch.count_nonzero(clone(x)) == 0
    assert torch.count_nonzero(model(x)) > 0
    assert clone(x).dtype == model(x).dtype == torch.float32


def test_a_model_with_a_policy_saves_and_loads_whole():
    model = mp.apply_policy(_mlp(), "mixed_bfloat16")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.ones(2, 4)
    assert torch.equal(loaded(x), model(x)) and loaded(x).dtype == torch.bfloat16
    assert [r.policy for r in mp.describe(loaded)] == [r.policy for r in mp.describe(model)]
    mp.remove_policy(loaded)
    assert loaded(x).dtype == torch.float32


def test_a_checkpoint_holding_policies_loads_weights_only_as_lightning_loads_it():
    """torch.load's default (weights_only=True, what Lightning's load_from_checkpoint uses) reads a
    policy, and a policy's dtype, kept in a checkpoint's hyperparameters."""
    policies = [mp.Policy("mixed_float16"), mp.Policy("float8_from_mixed_bfloat16", amax_history_len=16),
                mp.Policy("bfloat16_stochastic_int8", reduce_dtype="e5m2")]
    buf = io.BytesIO()
    torch.save({"hyper_parameters": {"policies": policies, "dtype": policies[0].compute_dtype}}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["hyper_parameters"]
    assert loaded["policies"] == policies and loaded["dtype"] == torch.float16 == loaded["policies"][0].compute_dtype


@pytest.mark.parametrize("policy", ["bfloat16", "float16"])
def test_removing_a_pure_policy_gives_back_the_unrounded_values(policy):
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    mp.apply_policy(model, policy)
    with torch.no_grad():  # a value changed under the policy is kept, widened
        model[0].bias[0] = 0.5
    mp.remove_policy(model)
    after = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    assert after[1][0].item() == 0.5
    before[1][0] = 0.5
    for a, b in zip(after, before):
        assert torch.equal(a, b)


def test_an_override_on_attention_out_proj_warns_and_describe_tells_the_truth():
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    with pytest.warns(UserWarning, match="MultiheadAttention reads its weight directly"):
        mp.apply_policy(layer, "mixed_bfloat16", {"self_attn.out_proj": "float32"})
    rows = {r.path: r for r in mp.describe(layer)}
    assert rows["self_attn.out_proj"].policy == mp.Policy("mixed_bfloat16")
    assert rows["linear1"].policy == mp.Policy("mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a class key that also names Linear elsewhere ...
        with pytest.raises(UserWarning, match="out_proj"):
            mp.apply_policy(layer, "mixed_bfloat16", {torch.nn.Linear: "float32"})
    with pytest.warns(UserWarning):
        mp.apply_policy(layer, "mixed_bfloat16", {torch.nn.Linear: "float32"})
    rows = {r.path: r for r in mp.describe(layer)}
    assert rows["linear1"].policy == mp.Policy("float32")  # ... still reaches the others
    assert rows["self_attn.out_proj"].policy == mp.Policy("mixed_bfloat16")
