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


def test_an_optimizer_that_would_round_to_nearest_is_refused_with_the_one_that_does_not():
    model = mp.apply_policy(_model(), "bfloat16_stochastic")
    with pytest.raises(ValueError, match=r"AdamW rounds each update to nearest; use torchao.optim._AdamW"):
        mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match="keeps its state in bfloat16, the policy asks for int8.*AdamW8bit"):
        mp.LossScaleOptimizer(torchao_optim._AdamW(model.parameters(), bf16_stochastic_round=True),
                              policy="bfloat16_stochastic_int8")
    with pytest.raises(ValueError, match="no Kahan-summation optimizer"):
        mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()), policy="p=bf16,rounding=kahan")
    # the optimizer that does it, and the plain one under a plain pure policy
    mp.LossScaleOptimizer(torchao_optim.AdamW8bit(model.parameters(), bf16_stochastic_round=True),
                          policy="bfloat16_stochastic_int8")
    mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()), policy="bfloat16")


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
