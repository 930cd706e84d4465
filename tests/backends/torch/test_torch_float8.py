"""fp8 matmuls on torch through torchao's Float8Linear, chosen by the plan (issue 29).

On a CPU torchao's fp8 path runs emulated (``torch._scaled_mm`` in float32), so these check
numerics against torchao's own ``convert_to_float8_training``, never speed.
"""

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import require_module

import mixedpolicy as mp

torch = require_module("torch")


def _net(seed=0):
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Embedding(10, 32), nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48),
                         nn.LayerNorm(48), nn.Linear(48, 10), nn.Linear(10, 10))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 10, (16, 2), generator=g), torch.randint(0, 10, (16,), generator=g)


def _train(model, steps=3, autocast=None):
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                out = model(x)
        else:
            out = model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _torchao(recipe, autocast=None):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    theirs = _net()
    # the layers the built-in rules leave to fp8: not the head (7), not 48->10 (6)
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda _m, fqn: fqn in ("2", "4"))
    return theirs, _train(theirs, autocast=autocast)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_recipe_equals_torchaos_own_conversion_bit_for_bit(recipe):
    require_module("torchao")
    theirs, their_losses = _torchao(recipe)
    ours = mp.apply_policy(_net(), mp.Policy("float32", float8_recipe=recipe))
    assert _train(ours) == their_losses
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_mixed_bfloat16_source_equals_torchao_under_torchs_autocast():
    require_module("torchao")
    theirs, their_losses = _torchao("tensorwise", autocast=torch.bfloat16)
    ours = mp.apply_policy(_net(), mp.Policy("mixed_bfloat16", float8_recipe="tensorwise"))
    assert _train(ours) == their_losses
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))


def test_describe_shows_the_recipe_and_the_built_in_rules_and_a_key_overrides_them():
    require_module("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model = mp.apply_policy(_net(), "params=float32,compute=bfloat16,float8=rowwise")
    rows = {r.path: r for r in mp.describe(model)}
    assert rows["2"].float8 == rows["4"].float8 == "rowwise"
    kept = {"0": "embeddings", "5": "normalization", "6": "not multiples of 16", "7": "the output head"}
    for path, why in kept.items():
        assert rows[path].float8 == "-" and why in rows[path].source, rows[path]
    assert rows["7"].policy == mp.Policy("mixed_bfloat16")  # the source precision
    # no matmul of their own, nothing in fp8: the container, Flatten, ReLU (their policy kept)
    for path in ("", "1", "3"):
        assert rows[path].float8 == "-" and rows[path].policy.float8_recipe is not None, rows[path]
    assert "fp8" in str(mp.describe(model)).splitlines()[0]
    assert [type(model[i]) for i in (2, 4)] == [Float8Linear, Float8Linear] and type(model[7]) is torch.nn.Linear
    # a key beats a rule: the head in fp8 by path, a layer kept out by class
    fp8 = mp.Policy("mixed_bfloat16", float8_recipe="tensorwise")
    model = mp.apply_policy(_net(), mp.PolicyMap(fp8, {"7": fp8, "4": "mixed_bfloat16"}))
    assert type(model[7]) is Float8Linear and type(model[4]) is torch.nn.Linear
    assert mp.describe(model)[8].source == "map key '7'"


def test_the_parameters_stay_the_same_tensors_and_remove_policy_restores_the_layers():
    require_module("torchao")
    model = _net()
    before = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before: still trains the fp8 layers
    mp.apply_policy(model, mp.Policy("float32", float8_recipe="tensorwise"))
    assert all(a is b for a, b in zip(model.parameters(), before))
    x, y = _data()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert before[1].grad is not None  # layer 2's weight, inside the Float8Linear
    keys = list(model.state_dict())
    mp.remove_policy(model)
    assert [type(m) for m in model] == [type(m) for m in _net()]
    assert all(a is b for a, b in zip(model.parameters(), before)) and list(model.state_dict()) == keys


def _resumed(model, policy):
    """Another model under `policy`, from `model`'s saved state_dict."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    twin = mp.apply_policy(_net(seed=5), policy)
    buffer.seek(0)
    twin.load_state_dict(torch.load(buffer))
    return twin


def test_a_checkpoint_resumes_bit_for_bit():
    require_module("torchao")
    policy = mp.Policy("float32", float8_recipe="tensorwise")
    a = mp.apply_policy(_net(), policy)
    _train(a, steps=2)
    b = _resumed(a, policy)
    assert _train(a, steps=2) == _train(b, steps=2)


@pytest.mark.parametrize("recipe, says", [("mxfp8", "MoE grouped matmuls")])
def test_a_recipe_torch_cannot_run_is_refused_before_anything_changes(recipe, says):
    model = _net()
    with pytest.raises(ValueError, match=f"Received the fp8 recipe '{recipe}' for torch layer '2'.*{says}.*"
                                         f"Nothing was applied"):
        mp.apply_policy(model, mp.Policy("mixed_bfloat16", float8_recipe=recipe))
    assert [type(m) for m in model] == [type(m) for m in _net()]
    assert all(not hasattr(m, "_mixedpolicy") for m in model.modules())
    assert mp.describe(model)[0].source == "no policy applied"


_KERAS_SIDE_BY_SIDE = textwrap.dedent("""
    import json, os
    os.environ["KERAS_BACKEND"] = "torch"
    import numpy as np, torch, keras, mixedpolicy as mp
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    theirs = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu", name="a"),
                               keras.layers.Dense(16, name="b")])
    for i, name in ((0, "a"), (2, "b")):
        theirs.get_layer(name).set_weights([ours[i].weight.detach().numpy().T, ours[i].bias.detach().numpy()])
    policy = mp.Policy("float8_from_float32", amax_history_len=4)
    mp.apply_policy(ours, mp.PolicyMap(policy, {"2": policy}))
    mp.apply_policy(theirs, mp.PolicyMap(policy, {"b": policy}))
    opt = torch.optim.SGD(ours.parameters(), lr=0.01)
    theirs.compile(keras.optimizers.SGD(0.01), "mse")
    rng = np.random.default_rng(0)
    losses = []
    for step in range(4):
        x, y = rng.normal(size=(8, 32)).astype("float32") * (step + 1), np.zeros((8, 16), "float32")
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ours(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        opt.step()
        losses.append([loss.item(), float(theirs.train_on_batch(x, y))])
    a, k = ours[0], theirs.get_layer("a")
    np_ = keras.ops.convert_to_numpy
    print(json.dumps({"losses": losses,
                      "ours": [float(a.input_scale), float(a.weight_scale), float(a.grad_scale),
                               a.input_amax_history.tolist()],
                      "keras": [float(np_(k.inputs_scale)), float(np_(k.kernel_scale)),
                                float(np_(k.outputs_grad_scale)), np_(k.inputs_amax_history).tolist()]}))
""")


def test_delayed_on_torch_is_keras_delayed_algorithm_around_scaled_mm():
    """torchao has no delayed scaling: ours is Keras's algorithm around torch._scaled_mm, so the
    same weights and inputs give Keras's scales and amax histories (within float32 rounding)."""
    require_module("keras")
    proc = subprocess.run([sys.executable, "-c", _KERAS_SIDE_BY_SIDE], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, KERAS_BACKEND="torch"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    np = pytest.importorskip("numpy")
    # the input's scale and history come from the data alone; the weight's and the gradient's
    # from four steps of two programs' float32 matmuls (their accumulation order differs by CPU)
    np.testing.assert_allclose(got["ours"][0], got["keras"][0], rtol=1e-6)
    np.testing.assert_allclose(got["ours"][3], got["keras"][3], rtol=1e-6)
    np.testing.assert_allclose(got["ours"][1:3], got["keras"][1:3], rtol=1e-5)
    for ours, theirs in got["losses"]:
        assert ours == pytest.approx(theirs, rel=2e-3)  # fp8 roundings of values a float32 ulp apart


def test_delayed_state_is_in_the_state_dict_and_resumes_bit_for_bit():
    from mixedpolicy.backends.torch.float8_delayed import DelayedFloat8Linear

    policy = mp.Policy("mixed_bfloat16", float8_recipe="delayed", amax_history_len=8)
    a = mp.apply_policy(_net(), policy)
    assert type(a[2]) is DelayedFloat8Linear and mp.describe(a)[3].float8 == "delayed"
    _train(a, steps=2)
    assert "2.input_amax_history" in a.state_dict() and a[2].input_amax_history.shape == (8,)
    assert float(a[2].grad_scale) != 1.0  # the backward wrote its next scale
    b = _resumed(a, policy)
    assert _train(a, steps=2) == _train(b, steps=2)
    mp.remove_policy(a)
    assert type(a[2]) is torch.nn.Linear and "2.input_amax_history" not in a.state_dict()


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_a_pure_bfloat16_source_keeps_fp8_scales_in_float32_and_trains(recipe):
    if recipe == "tensorwise":
        require_module("torchao")
    model = mp.apply_policy(_net(), mp.Policy("bfloat16", float8_recipe=recipe))
    assert model[2].weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for b in model[2].buffers())
    losses = _train(model, steps=3)
    assert all(map(lambda v: v == v and abs(v) < 1e3, losses))


def test_the_auto_filter_converts_the_layers_it_passes_as_torchao_converts_them_and_trains_alike():
    require_module("torchao")
    from mixedpolicy.bench.runners.float8 import torchao_float8

    def sized(seed=0):
        torch.manual_seed(seed)
        nn = torch.nn
        return nn.Sequential(nn.Linear(1040, 2064), nn.ReLU(), nn.Linear(2064, 64), nn.ReLU(), nn.Linear(64, 64),
                             nn.ReLU(), nn.Linear(64, 10))

    fp8 = mp.Policy("p=f32,c=bf16,float8=tensorwise")
    ours = mp.apply_policy(sized(), mp.PolicyMap(fp8, float8_auto_filter=True))
    theirs = torchao_float8(sized(), "tensorwise", auto_filter=True)
    converted = [name for name, m in theirs.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted == ["0"]  # 1040 -> 2064 is large enough; 2064 -> 64 and 64 -> 64 are not
    assert [n for n, m in ours.named_modules() if type(m).__name__ == "Float8Linear"] == converted
    assert "too small" in mp.describe(ours)[3].source
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1040, generator=g), torch.randint(0, 10, (16,), generator=g)
    losses = []
    for net, autocast in ((ours, False), (theirs, True)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses.append([])
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(net(x).float(), y)
            loss.backward()
            opt.step()
            losses[-1].append(loss.item())
    assert losses[0] == losses[1]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_rowwise_with_gw_hp_trains_under_a_mixed_source_on_a_cpu(policy):
    """torchao's Float8Linear casts its input to the autocast dtype under CUDA's autocast only;
    on a CPU its high-precision weight gradient then met a float32 input and failed. The adapter
    casts as torchao does on CUDA, on any device."""
    require_module("torchao")
    model = mp.apply_policy(_net(), mp.Policy(policy, float8_recipe="rowwise_with_gw_hp"))
    losses = _train(model, steps=3, autocast=None)
    assert all(v == v for v in losses) and losses[-1] < losses[0]
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model[2].parameters())
    mp.remove_policy(model)
    assert type(model[2]) is torch.nn.Linear and not model[2]._forward_pre_hooks
