"""A memory policy on torch: the model in bfloat16 without a master copy, the updates through
torchao's stochastic-rounding and 8-bit AdamW, which the wrapper takes as they are (and refuses
an optimizer that would update otherwise)."""

import copy

import pytest

from conftest import require_module

torch = require_module("torch")
torchao_optim = pytest.importorskip("torchao.optim")
import mixedpolicy as mp  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def _train(model, opt, steps=3, poison=None):
    x, y = _batch()
    torch.manual_seed(5)  # the stochastic rounding's draws
    for i in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        (loss * float("inf") if i == poison else loss).backward()
        opt.step()
        opt.zero_grad()
    return model


def test_what_torch_cannot_carry_is_refused_with_what_does():
    model = mp.apply_policy(_model(), "bfloat16_stochastic")
    with pytest.raises(ValueError, match="AdamW8bit rounds each update to nearest; give it bf16_stochastic_round=True"):
        mp.LossScaleOptimizer(torchao_optim.AdamW8bit(model.parameters()), policy="bfloat16_stochastic_int8")
    with pytest.raises(ValueError, match="keeps its state in bfloat16, the policy asks for int8"):
        mp.LossScaleOptimizer(torchao_optim._AdamW(model.parameters(), bf16_stochastic_round=True),
                              policy="bfloat16_stochastic_int8")
    with pytest.raises(ValueError, match="8-bit block-quantized state is torchao's"):
        mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()), policy="bfloat16_stochastic_int8")
    inside = torchao_optim._AdamW(model.parameters(), bf16_stochastic_round=False)
    with pytest.raises(ValueError, match="no Kahan compensation can reach"):
        mp.LossScaleOptimizer(inside, policy="p=bf16,rounding=kahan")
    assert "step" not in vars(inside)  # refused: the optimizer was left as it was
    mp.LossScaleOptimizer(torchao_optim.AdamW8bit(model.parameters(), bf16_stochastic_round=True),
                          policy="bfloat16_stochastic_int8")


def test_the_rule_around_any_optimizer_rounds_stochastically_with_the_bits_optax_and_keras_draw():
    from mixedpolicy.backends.torch.rounding import random_bits16, stochastic_round_bfloat16

    assert random_bits16((8,), 3, 2).tolist() == [30602, 37930, 56895, 27383, 42306, 40381, 57622, 52687]
    x = torch.full((100_000,), 1.0 + 2.0**-10)
    r = stochastic_round_bfloat16(x, random_bits16(x.shape, 0, 0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0078125}
    assert abs(float(r.mean()) - (1.0 + 2.0**-10)) < 1e-4


def _reference_bits16(size, step, index, seed=0x5EED):
    """The counter-based hash in uint64 numpy arithmetic masked to 32 bits (the rules' definition)."""
    import numpy as np

    mask = np.uint64(0xFFFFFFFF)

    def mix(h):
        h = h ^ (h >> np.uint64(16))
        h = (h * np.uint64(0x85EBCA6B)) & mask
        h = h ^ (h >> np.uint64(13))
        h = (h * np.uint64(0xC2B2AE35)) & mask
        return h ^ (h >> np.uint64(16))

    start = np.uint64((step * 0x9E3779B1 + ((index * 668265261 + seed) & 0x7FFFFFFF)) & 0xFFFFFFFF)
    h = mix((np.arange(size, dtype=np.uint64) * np.uint64(0x9E3779B1) + start) & mask)
    return (mix((h + start) & mask) & np.uint64(0xFFFF)).astype(np.int64)


@pytest.mark.parametrize("way", ["numpy", "slices", "one-repeat"])
def test_the_bits_of_all_parameters_at_once_are_each_parameters_own(monkeypatch, way):
    """The torch rule hashes a step's parameters together in int32 (products wrapping as the
    masked definition's do), in chunks: each parameter's bits are still the hash of its own
    element positions, index and step, across chunk boundaries and for a parameter larger than
    a chunk."""
    import numpy as np

    from mixedpolicy.backends.torch import rounding as updates

    monkeypatch.setattr(updates, "_CHUNK", 1000)
    # a CPU's way (numpy's uint32, or torch's int32 slice by slice), or the GPU's (one repeat)
    monkeypatch.setattr(updates, "_SLICED", {"cpu"} if way != "one-repeat" else set())
    if way != "numpy":
        monkeypatch.setattr(updates, "_by_numpy", lambda *args: False)
    sizes, indices = [700, 200, 2500, 1, 99], [0, 1, 2, 3, 7]
    got = updates.random_bits16_all(sizes, indices, 123456789, None, 0x5EED)
    on_device = updates.random_bits16_all(sizes, indices, torch.tensor(123456789), None, 0x5EED)  # Keras's step variable
    for size, index, bits, bits_of_tensor_step in zip(sizes, indices, got, on_device):
        assert bits.dtype == torch.int32 and bits.shape == (size,)
        np.testing.assert_array_equal(bits.numpy(), _reference_bits16(size, 123456789, index))
        assert torch.equal(bits, bits_of_tensor_step)


def test_the_one_kernel_rounding_computes_the_separate_ops_bits(monkeypatch, caplog):
    """The function CUDA compiles into one kernel (run here uncompiled, the same arithmetic)
    rounds a flat buffer exactly as the separate ops do, across chunks and wrapping steps; and
    where the compiler fails the separate ops round instead, with a warning that says so."""
    from mixedpolicy.backends.torch import rounding

    monkeypatch.setattr(rounding, "_CHUNK", 1000)
    sizes, indices = [700, 200, 2500, 1, 99], [0, 1, 2, 3, 7]
    x = torch.randn(sum(sizes))
    monkeypatch.setattr(rounding, "_FUSED", {"cpu"})
    for step in (0, 123456789, 2**31 + 5):
        monkeypatch.setattr(rounding, "_compiled", lambda: rounding._round_chunk_)
        separate, fused = x.clone(), x.clone()
        start = 0  # the separate ops: what every device without the kernel runs
        for h, _ in rounding._bits_by_chunk(sizes, indices, step, "cpu"):
            separate[start:start + h.numel()].view(torch.int32).add_(h).bitwise_and_(-65536)
            start += h.numel()
        rounding.round_flat_(fused, sizes, indices, step, "cpu")
        assert torch.equal(fused, separate)
        assert torch.equal(fused, fused.bfloat16().float())  # exact in bfloat16

    calls = []

    def broken_after_a_chunk(*args):  # a kernel that builds once, then fails (a recompile)
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("no C++ compiler")
        return rounding._round_chunk_(*args)

    monkeypatch.setattr(rounding, "_compiled", lambda: broken_after_a_chunk)
    fallback = x.clone()
    with caplog.at_level("WARNING", logger="mixedpolicy"):
        rounding.round_flat_(fallback, sizes, indices, 2**31 + 5, "cpu")
    assert torch.equal(fallback, separate)  # the first chunk rounded once, the rest by the ops
    assert "could not build or run the stochastic-rounding kernel" in caplog.text and "no C++ compiler" in caplog.text
    assert "cpu" not in rounding._FUSED  # asked once: later steps take the separate ops at once


def _digits_accuracy(policy, steps=400):
    from sklearn.datasets import load_digits
    import numpy as np

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.data))
    x = torch.tensor(digits.data[order] / 16, dtype=torch.float32)
    y = torch.tensor(digits.target[order])
    torch.manual_seed(0)
    net = mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)),
                          policy)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), policy=policy)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        batch = torch.tensor(rng.integers(0, 1400, 64))
        opt.scale_loss(torch.nn.functional.cross_entropy(net(x[batch]).float(), y[batch])).backward()
        opt.step()
        opt.zero_grad()
    assert {p.dtype for p in net.parameters()} == {getattr(torch, mp.Policy(policy).variable_dtype)}
    with torch.no_grad():
        return 100 * float((net(x[1400:]).float().argmax(-1) == y[1400:]).float().mean())


def test_pure_bfloat16_sgd_with_stochastic_rounding_or_kahan_trains_like_the_float32_master():
    master, nearest, stochastic, kahan = (_digits_accuracy(p) for p in (
        "mixed_bfloat16", "bfloat16", "bfloat16_stochastic", "p=bf16,rounding=kahan"))
    # measured (2-core AMD EPYC): 74.1 (float32 master), 57.4 (nearest), 73.1 (stochastic), 74.1 (Kahan)
    assert abs(stochastic - master) <= 2.5 and abs(kahan - master) <= 2.5, (master, stochastic, kahan)
    assert nearest < master - 8, (master, nearest)


def test_the_rule_keeps_the_state_dtype_and_resumes_bit_for_bit(tmp_path):
    def run(steps, model=None, opt=None):
        model = model or mp.apply_policy(_model(), "p=bf16,rounding=stochastic,state=float32")
        opt = opt or mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                           policy="p=bf16,rounding=stochastic,state=float32")
        return _train(model, opt, steps=steps), opt

    straight, _ = run(5)
    model, opt = run(3)
    state = opt.inner_optimizer.state[model[0].weight]
    assert model[0].weight.dtype == torch.bfloat16 and state["exp_avg"].dtype == torch.float32
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model = mp.apply_policy(_model(), "p=bf16,rounding=stochastic,state=float32")
    model.load_state_dict(saved["model"])
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                policy="p=bf16,rounding=stochastic,state=float32")
    opt.load_state_dict(saved["opt"])  # the rounding's step count comes back with the param groups
    resumed, _ = run(2, model, opt)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def test_stochastic_rounding_through_torchao_is_torchaos_own_bit_for_bit_and_skips_what_is_not_finite():
    ours = mp.apply_policy(_model(), "bfloat16_stochastic")
    theirs = copy.deepcopy(ours)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16, torch.float32}  # the norm keeps float32
    opt = mp.LossScaleOptimizer(torchao_optim._AdamW(ours.parameters(), lr=1e-3, bf16_stochastic_round=True))
    _train(ours, opt)
    _train(theirs, torchao_optim._AdamW(theirs.parameters(), lr=1e-3, bf16_stochastic_round=True))
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    # weights 2 + gradients 2 + two bfloat16 moments 4: 8 bytes per bfloat16 parameter
    state = opt.inner_optimizer.state[ours[0].weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    before = [p.detach().clone() for p in ours.parameters()]
    _train(ours, opt, steps=1, poison=0)  # an infinite loss: skipped, as under every policy
    assert opt.num_skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))


def test_a_checkpoint_moves_between_state_dtypes_converting_and_saying_so_once(caplog):
    model = mp.apply_policy(torch.nn.Linear(64, 128), "bfloat16_stochastic")  # 8192 weights: 8-bit blocks
    plain = mp.LossScaleOptimizer(torchao_optim._AdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True))
    _train(model, plain, steps=2)
    saved = plain.state_dict()
    eight = mp.LossScaleOptimizer(torchao_optim.AdamW8bit(model.parameters(), lr=1e-3, bf16_stochastic_round=True),
                                  policy="bfloat16_stochastic_int8")
    with caplog.at_level("WARNING", logger="mixedpolicy"):
        eight.load_state_dict(saved)
    lines = [r.getMessage() for r in caplog.records if "load_state_dict" in r.getMessage()]
    assert len(lines) == 1 and "saved in bfloat16" in lines[0] and "AdamW8bit keeps it in bfloat16/int8" in lines[0]
    state = eight.inner_optimizer.state[model.weight]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit"  # torch's own load left it full width
    torch.testing.assert_close(state["exp_avg"].dequantize().float(), saved["state"][0]["exp_avg"].float(),
                               rtol=0.05, atol=1e-4)
    # and back: dequantized, said once; the same recipe loads silently
    back = mp.LossScaleOptimizer(torchao_optim._AdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True))
    caplog.clear()
    with caplog.at_level("WARNING", logger="mixedpolicy"):
        back.load_state_dict(eight.state_dict())
        assert type(back.inner_optimizer.state[model.weight]["exp_avg"]) is torch.Tensor
        again = mp.LossScaleOptimizer(torchao_optim._AdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True))
        again.load_state_dict(back.state_dict())
    assert [r.getMessage() for r in caplog.records if "load_state_dict" in r.getMessage()] == [
        next(r.getMessage() for r in caplog.records if "saved in bfloat16/int8" in r.getMessage())]


def test_per_layer_a_float32_master_beside_stochastic_rounding_and_describe_shows_both():
    policy = mp.PolicyMap("bfloat16_stochastic", {"3": "mixed_bfloat16"})  # the head keeps a float32 master
    model = mp.apply_policy(_model(), policy)
    rows = {row.path: row for row in mp.describe(model)}
    assert (rows["0"].update_rounding, rows["0"].optimizer_state_dtype) == ("stochastic", "bfloat16")
    assert (rows["3"].update_rounding, rows["3"].variable_dtype) == ("nearest", "float32")
    assert "rounding" in str(mp.describe(model)).splitlines()[0]
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=policy)
    _train(model, opt, steps=2)
    assert model[0].weight.dtype == torch.bfloat16 and model[3].weight.dtype == torch.float32
    assert opt.inner_optimizer.param_groups[0]["stochastic_rounding_step"] == 2


def test_a_copied_optimizer_under_the_rule_steps_its_own_parameters():
    import copy

    model = mp.apply_policy(_model(), "bfloat16_stochastic")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy="bfloat16_stochastic")
    twin_model = copy.deepcopy(model)
    twin = copy.deepcopy({"model": model, "opt": opt.inner_optimizer})  # one memo: the copy's own params
    before = [p.detach().clone() for p in model.parameters()]
    _train(twin["model"], twin["opt"], steps=1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the original untouched
    assert not all(torch.equal(a, b) for a, b in zip(twin_model.parameters(), twin["model"].parameters()))


def test_the_check_made_of_foreach_kernels_finds_what_torchs_amp_kernel_finds(monkeypatch):
    """CUDA's AMP unscale kernel takes no bfloat16 (a pure bfloat16 model failed its first step
    there): the check that stands in finds the same inf and NaN and unscales the same, and a
    (device, dtype) a kernel refuses is learned on the first refusal."""
    from mixedpolicy.backends.torch import found_inf as checks

    inf, nan = float("inf"), float("nan")
    for values in ([1.0, -2.5], [1.0, inf], [nan, 3.0], [-inf, 3e38]):
        for dtype in (torch.bfloat16, torch.float32):
            ours = [torch.tensor(values, dtype=dtype) * 4, torch.ones(3, dtype=dtype), torch.zeros(0, dtype=dtype)]
            theirs = [g.clone() for g in ours]
            found = [torch.zeros(()), torch.zeros(())]
            checks._unscale_and_check_by_norm(ours, found[0], torch.tensor(0.25))
            torch._amp_foreach_non_finite_check_and_unscale_(theirs, found[1], torch.tensor(0.25))
            assert found[0].item() == found[1].item(), (values, dtype)
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)

    def refuses(*args):
        raise NotImplementedError("not implemented for 'BFloat16'")

    monkeypatch.setattr(checks, "_AMP_KERNEL_LACKS", set())
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", refuses)
    found = torch.zeros(())
    checks.unscale_and_check_([torch.tensor([1.0, inf], dtype=torch.bfloat16)], found, torch.tensor(1.0))
    assert found.item() == 1 and checks._AMP_KERNEL_LACKS == {("cpu", torch.bfloat16)}


@pytest.mark.parametrize("policy", ["bfloat16", "bfloat16_stochastic"])
def test_a_pure_bfloat16_run_skips_and_steps_alike_where_the_amp_kernel_lacks_bfloat16(policy, monkeypatch):
    from mixedpolicy.backends.torch import found_inf as checks

    runs = []
    for lacks in (set(), {("cpu", torch.bfloat16)}):  # the CPU's kernel, then as on CUDA
        monkeypatch.setattr(checks, "_AMP_KERNEL_LACKS", lacks)
        model = mp.apply_policy(_model(), policy)
        opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), policy=policy)
        _train(model, opt, steps=3, poison=1)
        runs.append((model.state_dict(), opt.num_skipped_steps))
    assert runs[0][1] == runs[1][1] == 1
    for name, value in runs[0][0].items():
        torch.testing.assert_close(runs[1][0][name], value, rtol=0, atol=0, msg=name)


def test_pure_bfloat16_computes_what_module_to_bfloat16_does_but_the_norms_it_keeps_in_float32():
    """What a pure bfloat16 policy costs over `module.to(torch.bfloat16)` (11% of an eager GPT-2
    step on an H100): without the built-in rules the same aten ops forward and backward; with
    them, only the casts around the norms it keeps in float32."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    def ops(model, x):
        with Count() as count:
            count.ops = collections.Counter()
            model(x).float().sum().backward()
        return count.ops

    x = torch.randn(8, 64)
    native = ops(_model().to(torch.bfloat16), x.to(torch.bfloat16))
    cast = collections.Counter({"aten._to_copy.default": 1})  # the input into bfloat16 (native: outside)
    assert ops(mp.apply_policy(_model(), mp.PolicyMap("bfloat16", builtin_rules=False)), x) == native + cast
    extra = ops(mp.apply_policy(_model(), "bfloat16"), x) - native
    assert set(extra) == {"aten._to_copy.default"}, extra


def test_a_step_with_bfloat16_and_float32_gradients_that_both_overflow_counts_one_skip(monkeypatch):
    """A pure bfloat16 model keeps its norms in float32: where the bfloat16 gradients take the
    foreach check (CUDA) and the float32 ones torch's kernel, one device's flag says skipped once."""
    from mixedpolicy.backends.torch import found_inf as checks

    monkeypatch.setattr(checks, "_AMP_KERNEL_LACKS", {("cpu", torch.bfloat16)})
    torch.manual_seed(0)  # the float32 norm first: its gradients are checked before the bfloat16 ones
    net = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = mp.apply_policy(net, "bfloat16")
    assert [p.dtype for p in model.parameters()][:3] == [torch.float32, torch.float32, torch.bfloat16]
    # fused: the flag is counted on the device, as on a GPU (a non-fused step reads it as a bool)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, fused=True), policy="bfloat16")
    _train(model, opt, steps=2, poison=0)
    assert opt.num_skipped_steps == 1


def test_a_rule_that_fails_mid_step_leaves_the_model_its_own_bfloat16_weights(monkeypatch):
    """The rule swaps float32 copies in for the step's length; should the rounding fail (a
    device out of memory, say), the error reaches the caller and every parameter is its own
    bfloat16 tensor again with its gradient, the weights as before the step."""
    from mixedpolicy.backends.torch import updates

    torch.manual_seed(0)
    net = mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), "bfloat16_stochastic")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), policy="bfloat16_stochastic")
    opt.scale_loss(net(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum()).backward()
    before = [p.detach().clone() for p in net.parameters()]
    grads = [p.grad for p in net.parameters()]

    def failing(*args):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(updates, "round_flat_", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step()
    for p, old, grad in zip(net.parameters(), before, grads):
        assert p.dtype == torch.bfloat16 and p.grad is grad and torch.equal(p.detach(), old)
