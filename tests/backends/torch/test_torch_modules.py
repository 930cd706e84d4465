"""PyTorch: apply_policy on nn.Module, per-module overrides, describe, removal, torch.compile."""

import copy
import warnings

import pytest

from conftest import require_module

torch = require_module("torch")
import mixedpolicy as mp  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def make(seed=0):
    torch.manual_seed(seed)
    return Net()


def record_dtypes(model):
    seen = {}
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, (i[0], o)))
    return seen


@pytest.mark.parametrize("name, half", [("mixed_bfloat16", torch.bfloat16), ("mixed_float16", torch.float16)])
def test_mixed_policy_keeps_float32_weights_and_computes_in_half(name, half):
    model = mp.apply_policy(make(), name)
    seen = record_dtypes(model)
    out = model(torch.randn(3, 8))
    assert out.dtype == half
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert seen["encoder.0"][1].dtype == half  # the Linear ran in half precision
    # LayerNorm: statistics computed in float32, result handed on in half precision
    ln, (inp, out_ln) = model.encoder[1], seen["encoder.1"]
    assert out_ln.dtype == half
    assert_float32_then_rounded(out_ln, torch.nn.functional.layer_norm(inp.float(), (16,), ln.weight, ln.bias))


def assert_float32_then_rounded(out, exact):
    """`out` is `exact` (a float32 computation) rounded once: at most one unit in the last place."""
    ulp = torch.finfo(out.dtype).eps * exact.abs().clamp_min(torch.finfo(out.dtype).tiny)
    assert ((out.float() - exact).abs() <= ulp).all()


def has_region(module):
    """Whether `module` got a region of its own (not just an entry into its parent's)."""
    return type(vars(module).get("forward")).__name__ == "_Region"


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [lambda: torch.nn.BatchNorm2d(6), lambda: torch.nn.GroupNorm(2, 6),
                                  lambda: torch.nn.LayerNorm([6, 5, 5]), lambda: torch.nn.InstanceNorm2d(6, affine=True),
                                  lambda: torch.nn.InstanceNorm2d(6)])
def test_norms_compute_in_float32_inside_the_autocast_region(norm, half):
    # PyTorch's norm kernels take the half activations with float32 parameters and compute
    # in float32: the rule needs no region (no casts, no float32 copy of the activations).
    # Without parameters they would compute in half: such a norm gets a float32 region.
    policy = {torch.bfloat16: "mixed_bfloat16", torch.float16: "mixed_float16"}[half]
    model = mp.apply_policy(torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), norm(), torch.nn.ReLU()),
                            policy)
    assert has_region(model[1]) == (model[1].weight is None) and has_region(model)
    assert {row.path: row for row in mp.describe(model)}["1"].policy.compute_dtype == "float32"
    seen = record_dtypes(model)
    x = torch.randn(4, 3, 5, 5) * 4 + 3
    model(x).float().sum().backward()
    inp, out = seen["1"]
    assert inp.dtype == half and model[0].weight.grad.dtype == torch.float32
    reference = copy.deepcopy(model[1]).float()
    assert_float32_then_rounded(out, reference(inp.float()))


def test_float32_policy_reproduces_plain_pytorch_bit_for_bit():
    x = torch.randn(16, 8)
    plain, ours = make(), mp.apply_policy(make(), "float32")
    assert torch.equal(plain(x), ours(x))
    for model in (plain, ours):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x).square().mean().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), ours.parameters()))


def test_mixed_policy_matches_hand_written_autocast():
    x = torch.randn(16, 8)
    plain, ours = make(), mp.apply_policy(make(), "mixed_bfloat16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(x)
    assert torch.equal(ours(x), expected)


def test_overrides_by_path_glob_and_class():
    model = mp.apply_policy(make(), "mixed_bfloat16", {"head": "float32", torch.nn.GELU: "float32"})
    seen = record_dtypes(model)
    out = model(torch.randn(2, 8))
    assert out.dtype == torch.float32 and seen["head"][1].dtype == torch.float32
    assert seen["encoder.2"][1].dtype == torch.float32
    table = {row.path: row for row in mp.describe(model)}
    assert table["head"].source == "map key 'head'"
    assert "GELU" in table["encoder.2"].source
    assert table["encoder.1"].source == "built-in rule: normalization"


def test_pure_policy_casts_parameters_but_not_norms_and_removal_restores():
    model = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mp.apply_policy(model, "bfloat16")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["encoder.0.weight"] == torch.bfloat16 and dtypes["head.bias"] == torch.bfloat16
    assert dtypes["encoder.1.weight"] == torch.float32  # the norm rule
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16
    assert model.encoder[0](torch.randn(2, 8)).dtype == torch.bfloat16  # called directly: cast in
    mp.remove_policy(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert model(torch.randn(2, 8)).dtype == torch.float32
    assert mp.describe(model)[0].source == "no policy applied"
    assert set(before) == {n for n, _ in model.named_parameters()}


def test_applying_twice_replaces_the_first_policy():
    model = mp.apply_policy(make(), "mixed_float16")
    mp.apply_policy(model, "mixed_bfloat16")
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16


def test_batchnorm_buffers_follow_the_policy():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    mp.apply_policy(model, "bfloat16")
    assert model[1].running_mean.dtype == torch.float32  # norm keeps float32 statistics
    assert model(torch.randn(8, 4)).dtype == torch.bfloat16


def test_integer_inputs_are_never_cast():
    emb = torch.nn.Embedding(10, 4)
    mp.apply_policy(emb, "bfloat16")
    assert emb(torch.tensor([1, 2])).dtype == torch.bfloat16


def test_weights_cast_after_the_policy_fail_with_what_happened_and_the_fix():
    """A region that casts its inputs meets weights in another dtype (the model cast after
    apply_policy, or FSDP2 gathering them in its mp_policy's dtype: fsdp_worker.py): torch's
    dtype error comes with what happened and the fix; other errors stand as they are."""
    net = mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)),
                          "bfloat16")
    net.float()
    with pytest.raises(RuntimeError, match=r"its weight '0.weight' is float32 at this call.*apply the policy "
                                           r"again after the cast") as caught:
        net(torch.randn(3, 8))
    assert "dtype" in str(caught.value.__context__)  # torch's own error, kept
    mp.apply_policy(net, "bfloat16")
    assert net(torch.randn(3, 8)).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # another error: torch's own
        net(torch.randn(3, 5))
    from mixedpolicy.backends.torch.regions import _weights_in_another_dtype

    net.float()  # a weight in another dtype, but an error that is not about dtypes: left as it is
    assert _weights_in_another_dtype(RuntimeError("shapes cannot be multiplied"), net, mp.Policy("bfloat16")) is None
    # a mixed policy's autocast region: model.half() after it failed in torch's words alone (as
    # torch.autocast does over float16 weights: "expect parameter to have scalar type of Float")
    mixed = mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)), "mixed_bfloat16")
    mixed.half()
    with pytest.raises(RuntimeError, match=r"keeps its weights in float32 and computes in bfloat16 through "
                                           r"torch.autocast.*'0.weight' is float16 at this call.*model.half\(\).*"
                                           r"cast the weights back \(model.to\(float32\)\)"):
        mixed(torch.randn(3, 8))
    inner = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    nested = mp.apply_policy(torch.nn.Sequential(inner, torch.nn.Linear(4, 2)),
                             mp.PolicyMap("mixed_bfloat16", {"0": "mixed_float16", "0.1": "float32"}))
    nested.half()
    with pytest.raises(RuntimeError, match="LayerNorm computes in float32") as caught:  # regions in regions:
        nested(torch.randn(3, 8))  # said once, by the first to see it
    assert str(caught.value).count("A layer of type") == 1
    mixed.to(torch.float32)
    assert mixed(torch.randn(3, 8)).dtype == torch.bfloat16 and mixed[0].weight.dtype == torch.float32


class _MadeInFloat32(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mix = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16)
        self.norm, self.head = torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, ids):
        position = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * torch.ones(16)  # float32
        return self.head(self.norm(self.mix(self.embed(ids) + torch.sin(position))))


@pytest.mark.parametrize("policy", ["bfloat16", "float16"])
def test_activations_turned_float32_inside_a_pure_forward_name_the_layer_not_a_kept_norm(policy):
    """A tensor made in float32 inside the forward promotes the activations (as it would under
    model.to(bfloat16)); the error named the norm the built-in rule keeps in float32 and spoke of
    FSDP2. It names the layer that failed, the cause and the fixes; a mixed policy runs it."""
    model = mp.apply_policy(_MadeInFloat32(), policy)
    ids = torch.randint(0, 50, (2, 6))
    with pytest.raises(RuntimeError, match=rf"The layer 'mix' \(Linear\) .* its weights in {policy} .*"
                                           r"dtype=x.dtype.*'mixed_") as caught:
        model(ids)
    assert "norm" not in str(caught.value) and "FSDP2" not in str(caught.value)
    mp.apply_policy(model, "mixed_" + policy)
    assert model(ids).dtype == getattr(torch, policy)  # autocast's: the head is a matmul


def test_a_pure_region_casts_floating_tensors_in_any_argument_structure():
    """Tensors, tuples, lists and dicts of plain values take a fast path; anything else
    (nested containers, named tuples) torch's pytree: every floating tensor is cast alike,
    nothing else is touched, and outputs leave in the output dtype."""
    import collections

    Pair = collections.namedtuple("Pair", "a b")

    class Echo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x, n, nested, pair, mask=None, flag=False):
            self.seen = [x.dtype, nested[0][0].dtype, nested[0][1].dtype, pair.a.dtype, mask.dtype]
            return {"x": x, "n": n, "nested": nested, "pair": pair, "mask": mask, "flag": flag,
                    "params": [self.w]}

    echo = mp.apply_policy(Echo(), "p=bf16,c=bf16,o=f16")
    f32, i64 = torch.ones(2), torch.arange(2)
    out = echo(f32, 3, [[f32, i64]], Pair(f32, "s"), mask=f32, flag=True)
    bf16 = torch.bfloat16
    # inside, floating inputs in the compute dtype; outputs leave in float16
    assert out["n"] == 3 and out["flag"] is True and out["pair"].b == "s" and isinstance(out["pair"], Pair)
    assert out["nested"][0][1].dtype == torch.int64
    for t in (out["x"], out["nested"][0][0], out["pair"].a, out["mask"], out["params"][0]):
        assert t.dtype == torch.float16, t.dtype
    assert echo.seen == [bf16, bf16, torch.int64, bf16, bf16] and echo.w.dtype == bf16


def test_loss_module_computes_in_float32():
    loss = mp.apply_policy(torch.nn.CrossEntropyLoss(), "mixed_float16")
    value = loss(torch.randn(4, 3, dtype=torch.float16), torch.tensor([0, 1, 2, 0]))
    assert value.dtype == torch.float32


def test_mixed_policy_on_half_weights_is_an_error():
    model = make().to(torch.float16)
    with pytest.raises(ValueError, match=r"'encoder.0.weight' is already float16.*model.float\(\)"):
        mp.apply_policy(model, "mixed_float16")
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing was changed


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_frozen_half_weights_under_a_mixed_policy_stay_as_they_are_and_train_as_under_autocast(half):
    """A LoRA model: frozen half-precision base weights (no master weights: they are not trained)
    and trainable float32 adapters. Kept half where the layer computes in half precision (no
    float32 copy), widened where it computes in float32 (a norm); the loop trains as autocast
    with GradScaler does; a float16 parameter unfrozen later is refused at the step, as GradScaler
    refuses its gradients."""
    policy = "mixed_float16" if half == torch.float16 else "mixed_bfloat16"

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        model.to(half).requires_grad_(False)
        model.append(torch.nn.Linear(4, 4))  # the trainable adapter, float32
        return model

    x = torch.randn(4, 8)
    theirs, ours = build(), mp.apply_policy(build(), policy)
    assert ours[0].weight.dtype == half and ours[1].weight.dtype == torch.float32 and ours[3].weight.dtype == torch.float32
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15, enabled=half == torch.float16)
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1)  # (frozen ones included, as users pass them)
    wrapper = mp.LossScaleOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1))
    for _ in range(3):
        with torch.autocast("cpu", dtype=half):
            loss = theirs(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        wrapper.scale_loss(ours(x).float().square().mean()).backward()
        wrapper.step()
        wrapper.zero_grad()
    assert wrapper.num_skipped_steps == 0
    torch.testing.assert_close(ours[3].weight, theirs[3].weight, rtol=1e-2, atol=1e-3)  # (norms: see the guide)
    mp.remove_policy(ours)
    assert [p.dtype for p in ours[:3].parameters()] == [half] * 6  # the widened norm given back
    if half == torch.float16:  # unfrozen: a float16 master weight, whose gradients GradScaler refuses too
        mp.apply_policy(ours, policy)
        ours[0].weight.requires_grad_(True)
        wrapper.scale_loss(ours(x).float().square().mean()).backward()
        with pytest.raises(ValueError, match="float16 gradients"):
            wrapper.step()


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_float16_weight_unfrozen_after_wrapping_is_refused_at_the_step_under_every_policy(policy):
    """The same misuse gets the same answer whether the wrapper scales or not: a float16 weight
    trained as its own master weight (GradScaler refuses its gradients; so does the pass-through)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).half().requires_grad_(False), torch.nn.Linear(4, 4))
    mp.apply_policy(model, policy)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # scaling, or not, as the policy says
    model[0].weight.requires_grad_(True)
    opt.scale_loss(model(torch.randn(2, 4)).float().sum()).backward()
    with pytest.raises(ValueError, match="float16 gradients"):
        opt.step()
    # a NoLossScale given by hand checks no weights: the documented way to train float16 ones
    by_hand = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=mp.NoLossScale())
    by_hand.step()


def test_unmatched_override_warns_with_nearest_paths():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.apply_policy(make(), "mixed_bfloat16", {"haed": "float32"})
    assert any("'haed' matches no layer path" in str(w.message) and "'head'" in str(w.message)
               for w in caught)


def test_torch_compile_has_no_graph_breaks():
    model = mp.apply_policy(make(), "mixed_bfloat16", {"head": "float32"})
    explanation = torch._dynamo.explain(model)(torch.randn(4, 8))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model)
    x = torch.randn(4, 8)
    assert torch.allclose(compiled(x), model(x), atol=1e-2)


def test_a_forward_that_breaks_torch_compiles_graph_runs_compiled():
    # any graph break inside a region's forward (a print, data-dependent control flow, a
    # Hugging Face model's loss) recursed without end: dynamo rebuilt the region's bound
    # forward as `module.forward`, the region itself
    class Breaks(Net):
        def forward(self, x):
            hidden = self.encoder(x)
            torch._dynamo.graph_break()
            return self.head(hidden)

    x = torch.randn(4, 8)
    for overrides in ({}, {"head": "float32"}, {"encoder": "bfloat16"}):
        torch.manual_seed(0)
        model = mp.apply_policy(Breaks(), "mixed_bfloat16", overrides)
        expected = model(x)
        compiled = torch.compile(model, backend="eager")
        out = compiled(x)
        assert out.dtype == expected.dtype and torch.allclose(out.float(), expected.float(), atol=1e-2)
        compiled(x.requires_grad_()).float().sum().backward()


def test_keys_written_for_the_bare_model_reach_it_compiled_or_checkpoint_wrapped():
    # torch.compile puts the model under `_orig_mod`, checkpoint_wrapper a block under
    # `_checkpoint_wrapped_module`: the paths a user writes for the bare model still name its
    # layers, describe prints those paths, and each printed path pastes back as a key
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    overrides = {"encoder.1": "float32", "head": "float32"}
    bare = mp.apply_policy(make(), "mixed_bfloat16", overrides)
    x = torch.randn(4, 8)
    wrapped = make()
    wrapped.encoder = checkpoint_wrapper(wrapped.encoder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no key is reported as matching nothing
        mp.apply_policy(wrapped, "mixed_bfloat16", overrides)
    rows = mp.describe(wrapped)
    assert [(r.path, r.layer_type, r.source) for r in rows] == \
        [(r.path, r.layer_type, r.source) for r in mp.describe(bare)]
    assert torch.equal(wrapped(x), bare(x))
    wrapped(x.requires_grad_()).sum().backward()  # the block recomputed in backward, in its policy

    compiled = torch.compile(make())
    mp.apply_policy(compiled, "mixed_bfloat16", overrides)
    assert [r.path for r in mp.describe(compiled)] == [r.path for r in rows]
    assert torch.allclose(compiled(x), bare(x), atol=1e-2) and compiled(x).dtype == torch.float32
    for row in rows:
        mp.apply_policy(compiled, mp.PolicyMap("mixed_bfloat16", {row.path: "float16"}))
        assert {r.path: r.source for r in mp.describe(compiled)}[row.path] == f"map key {row.path!r}"
    mp.remove_policy(compiled)
    mp.remove_policy(wrapped)
    assert not any("forward" in vars(m) for m in [*wrapped.modules(), *compiled._orig_mod.modules()])
    assert {r.source for r in mp.describe(compiled)} == {"no policy applied"}
    # torch.nn.DataParallel holds the model as `module`, as DDP does: its paths are the model's too
    parallel = torch.nn.DataParallel(make())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.apply_policy(parallel, "mixed_bfloat16", overrides)
    assert [(r.path, r.source) for r in mp.describe(parallel)] == [(r.path, r.source) for r in mp.describe(bare)]
    if not torch.cuda.is_available():  # (with GPUs, DataParallel moves the model to the first)
        assert torch.equal(parallel(x.detach()), bare(x.detach()))
    mp.remove_policy(parallel)
    assert {r.source for r in mp.describe(parallel)} == {"no policy applied"}


def test_explicit_output_dtype_is_honoured():
    model = mp.apply_policy(make(), "p=f32,c=bf16,o=f32")
    assert model(torch.randn(2, 8)).dtype == torch.float32


def test_a_submodule_called_directly_computes_as_describe_says():
    # model.encoder(x), timm's forward_features, a Hugging Face model.bert(...): a submodule
    # called outside its parent's forward computes in its region's policy, as a Keras layer
    # called on its own does; inside the region, or inside the user's own autocast, the
    # entry leaves the autocast state as it finds it.
    model, x = mp.apply_policy(make(), "mixed_float16"), torch.randn(3, 8)
    assert {row.path: row.policy.compute_dtype for row in mp.describe(model)}["encoder.0"] == "float16"
    with torch.autocast("cpu", dtype=torch.float16):
        expected = model.encoder(x)
    assert torch.equal(model.encoder(x), expected) and model.encoder[0](x).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the user's own autocast is theirs
        assert model.encoder[0](x).dtype == torch.bfloat16

    class Float32Head(Net):  # a model whose own code turns autocast off for its head
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return self.head(self.encoder(x).float())

    assert mp.apply_policy(Float32Head(), "mixed_float16")(x).dtype == torch.float32
    override = mp.apply_policy(make(), mp.PolicyMap("mixed_float16", {"encoder": "float32"}))
    assert override.encoder[0](x.half()).dtype == torch.float32  # the float32 region casts in
    copied = copy.deepcopy(model)
    assert copied.encoder[0](x).dtype == torch.float16
    mp.remove_policy(model)
    assert model.encoder(x).dtype == torch.float32 and not any("forward" in vars(m) for m in model.modules())


def test_torch_export_and_trace_keep_the_policy_of_the_model_and_of_a_submodule():
    # torch.export reads forward.__code__ (the argument names); a region answers for its forward
    model, x = mp.apply_policy(make(), "mixed_bfloat16"), torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(model, (x,)).module()
        encoder = torch.export.export(model.encoder, (x,)).module()
        traced = torch.jit.trace(model, (x,))
    # (the exported graph runs its own op sequence: equal within bfloat16 rounding, not bit for bit)
    assert exported(x).dtype == traced(x).dtype == torch.bfloat16
    torch.testing.assert_close(exported(x), model(x))
    assert encoder(x).dtype == torch.bfloat16
    torch.testing.assert_close(encoder(x), model.encoder(x))


def test_a_torchscript_module_is_refused_with_the_order_that_works():
    x = torch.randn(3, 8)
    for compiled in (torch.jit.script(make()), torch.jit.trace(make(), (x,))):
        for call in (lambda: mp.apply_policy(compiled, "mixed_bfloat16"), lambda: mp.describe(compiled)):
            with pytest.raises(TypeError, match="TorchScript module .* Apply the policy to the nn.Module, then trace it"):
                call()
        assert mp.remove_policy(compiled) is compiled  # nothing to remove


def test_a_refused_policy_leaves_the_model_under_the_policy_it_had():
    """The new policy is checked before the old one comes off: a refusal (here, float16 weights
    a mixed_float16 policy would train as master weights) changes nothing, where the old policy
    was taken off first and lost. Checked with the dtypes the old policy found, so a pure
    policy's half weights are not mistaken for the user's."""
    model = make()
    mp.apply_policy(model, mp.PolicyMap("mixed_bfloat16", {"head": "float32"}))
    before = [(r.path, r.policy) for r in mp.describe(model)]
    x = torch.randn(3, 8)
    model.encoder[0].half()  # the user's own change, after the policy
    with pytest.raises(ValueError, match="already float16"):
        mp.apply_policy(model, "mixed_float16")
    assert [(r.path, r.policy) for r in mp.describe(model)] == before
    model.encoder[0].float()  # still computing as before: the encoder in bfloat16, the head in float32
    assert model.encoder(x).dtype == torch.bfloat16 and model(x).dtype == torch.float32
    mp.apply_policy(model, "bfloat16")  # bfloat16 weights, then a mixed policy: not the user's
    mp.apply_policy(model, "mixed_bfloat16")
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16"])
def test_weights_quantized_by_torchao_after_the_policy_survive_its_removal(policy):
    """torchao's quantize_ after apply_policy swaps the weights for quantized tensors; removing
    the policy gives the rest back and leaves those as they are (its restore compared each weight
    with its original and stopped in torchao's "unimplemented operator" error)."""
    quantization = require_module("torchao.quantization", "torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mp.apply_policy(model, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torchao's own deprecation notes)
        quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    kind = type(model[0].weight)
    mp.remove_policy(model)
    assert type(model[0].weight) is kind and model[0].bias.dtype == torch.float32
    assert {r.source for r in mp.describe(model)} == {"no policy applied"}
    x = torch.randn(4, 64, dtype=model[0].weight.dtype)
    assert torch.isfinite(model(x)).all()
    mp.apply_policy(model, "mixed_bfloat16")  # and a policy goes on again
    assert torch.isfinite(model(x.float())).all()


def test_weights_pruned_or_parametrized_after_a_pure_policy_come_back_in_their_dtype():
    """torch.nn.utils.prune and parametrize move a weight the policy cast to bfloat16 into
    `weight_orig` / `parametrizations.weight.original*` (spectral_norm keeps vectors made from it):
    remove_policy gives those back in float32. It restored an attribute the next forward
    recomputes, and left the model failing with "must have the same dtype"."""
    from torch.nn.utils import parametrizations, prune

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    mp.apply_policy(model, "bfloat16")
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    parametrizations.weight_norm(model[2])
    parametrizations.spectral_norm(model[4])
    x = torch.randn(2, 8)
    assert model(x).dtype == torch.bfloat16
    mp.remove_policy(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model(x).dtype == torch.float32
    assert float((model[0].weight == 0).float().mean()) == 0.5  # the pruning mask kept


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "bfloat16"])
def test_a_transformer_encoder_in_eval_mode_computes_as_in_training(policy):
    """nn.TransformerEncoder and nn.MultiheadAttention take a fused kernel in eval mode without
    gradients (torch's "fastpath"), which needs every weight of the layer in the input's dtype:
    under a CPU autocast it failed ("expected scalar type Float but found BFloat16", as torch's
    own autocast does, pytorch/pytorch#132613), and under a pure policy it met the float32 norms.
    A region around such layers runs module by module, as in training, and puts torch's setting
    back (a user's own False kept)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 2)
    reference = copy.deepcopy(model)
    mp.apply_policy(model, policy)
    x = torch.randn(3, 8, 32)
    pad = torch.zeros(3, 8, dtype=torch.bool)
    pad[1, 5:] = True
    kept = ~pad
    trained = model(x, src_key_padding_mask=pad).detach()
    model.eval()
    for fastpath in (True, False):
        torch.backends.mha.set_fastpath_enabled(fastpath)
        try:
            with torch.no_grad():
                evaluated = model(x, src_key_padding_mask=pad)
                attention = model.layers[0].self_attn(x, x, x, need_weights=False)[0]
            assert torch.backends.mha.get_fastpath_enabled() is fastpath
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        assert evaluated.dtype == trained.dtype  # (the same modules; the attention kernel may differ without grad)
        torch.testing.assert_close(evaluated[kept], trained[kept])
        assert attention.dtype == getattr(torch, mp.Policy(policy).compute_dtype)
    if policy.startswith("mixed"):  # training under torch's own autocast takes the same modules
        half = getattr(torch, mp.Policy(policy).compute_dtype)
        with torch.autocast("cpu", dtype=half):
            expected = reference(x, src_key_padding_mask=pad)
        torch.testing.assert_close(trained[kept], expected[kept].detach(), rtol=0, atol=0)
