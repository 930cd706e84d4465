"""mixedpolicy's Lightning precision plugin inside Lightning Fabric (``Fabric(plugins=[...])``)
against Fabric's own MixedPrecision on the same seeded loop: losses, skipped steps, the scale,
clipping, two optimizers, a checkpoint through ``fabric.save``/``fabric.load``."""

import logging
import math
import warnings

import pytest

from conftest import require_module

torch = require_module("torch")
fabric_pkg = pytest.importorskip("lightning_fabric")
import mixedpolicy as mp  # noqa: E402
import mixedpolicy.lightning as mpl  # noqa: E402

POISON = 3  # the step whose loss is made infinite


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("lightning_fabric").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def _batches(n=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _own_16_mixed():
    return fabric_pkg.plugins.MixedPrecision("16-mixed", "cpu")  # (Fabric takes "16-mixed" as bf16 on a CPU)


def _run(plugin, *, clip=None, steps=8, fabric=None, model=None, opt=None, start=0):
    """A hand-written Fabric loop; the losses and, after each step, the scale as code written for
    Fabric's MixedPrecision reads it (its `scaler`, None where nothing is scaled)."""
    if fabric is None:
        fabric = fabric_pkg.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = _model()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses, scales = [], []
    for i, (x, y) in enumerate(_batches(steps)[start:], start):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        losses.append(float(loss))
        fabric.backward(loss * math.inf if i == POISON else loss)
        if clip:
            fabric.clip_gradients(model, opt, max_norm=clip, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()
        scaler = fabric._precision.scaler
        scales.append(None if scaler is None else float(scaler.get_scale()))
    return fabric, model, opt, losses, scales


def _weights(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "clipped"])
def test_16_mixed_under_fabric_matches_fabrics_own_plugin(clip):
    _, theirs_model, _, theirs_losses, theirs_scales = _run(_own_16_mixed(), clip=clip)
    plugin = mpl.Precision("16-mixed")  # from GradScaler's start, as Fabric's own
    fabric, model, _, losses, scales = _run(plugin, clip=clip)
    assert scales == theirs_scales and scales[POISON] == scales[0] / 2
    assert plugin.optimizer.num_skipped_steps == 1
    # the same steps: float16 compute in two orders of operations, so close, not equal
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(theirs_losses), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(_weights(model), _weights(theirs_model), rtol=5e-2, atol=5e-3)
    assert {row.compute_dtype for row in mp.describe(model) if row.path == "3"} == {"float16"}
    out = model(torch.randn(2, 16))
    assert out.dtype == torch.float32  # outputs in the default dtype, as Fabric's own plugin gives them


def test_bf16_mixed_under_fabric_skips_the_step_fabrics_own_plugin_applies():
    _, theirs, _, _, _ = _run(fabric_pkg.plugins.MixedPrecision("bf16-mixed", "cpu"))
    assert not torch.isfinite(_weights(theirs)).all()  # Fabric's own: the infinite step applied
    plugin = mpl.Precision("bf16-mixed", {"1": "float32"})  # with a per-layer override
    _, model, _, losses, scales = _run(plugin)
    assert scales == [None] * 8 and plugin.optimizer.num_skipped_steps == 1
    assert torch.isfinite(_weights(model)).all() and all(math.isfinite(v) for v in losses)
    computes = {row.path: row.compute_dtype for row in mp.describe(model)}
    assert computes["0"] == "bfloat16" and computes["1"] == "float32"


def test_two_optimizers_share_one_scale_as_fabrics_own_gradscaler():
    def run(plugin):
        fabric = fabric_pkg.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        gen, disc = _model(), _model()
        gen, opt_g = fabric.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.05))
        disc, opt_d = fabric.setup(disc, torch.optim.Adam(disc.parameters(), lr=1e-3))
        scales = []
        for i, (x, y) in enumerate(_batches()):
            loss_d = torch.nn.functional.cross_entropy(disc(x), y)
            fabric.backward(loss_d * math.inf if i == POISON else loss_d)
            opt_d.step()
            opt_d.zero_grad()
            fabric.backward(torch.nn.functional.cross_entropy(gen(x), y))
            opt_g.step()
            opt_g.zero_grad()
            scales.append(float(fabric._precision.scaler.get_scale()))
        return scales, _weights(gen), _weights(disc)

    theirs = run(_own_16_mixed())
    plugin = mpl.Precision("16-mixed", initial_scale=2.0**16)
    ours = run(plugin)
    assert ours[0] == theirs[0] and len(plugin.optimizer.inner_optimizers) == 2
    assert plugin.optimizer.num_skipped_steps == 1  # the discriminator's poisoned step alone
    for a, b in zip(ours[1:], theirs[1:]):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


def test_the_scale_rides_in_fabric_save_and_resumes_bit_for_bit(tmp_path):
    straight = _run(mpl.Precision("16-mixed"), steps=8)
    plugin = mpl.Precision("16-mixed")
    fabric, model, opt, _, _ = _run(plugin, steps=5)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "precision": plugin})
    fresh = mpl.Precision("16-mixed")
    fabric2 = fabric_pkg.Fabric(accelerator="cpu", devices=1, plugins=[fresh])
    model2 = _model()
    model2, opt2 = fabric2.setup(model2, torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9))
    fabric2.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2, "precision": fresh})
    *_, losses, scales = _run(fresh, fabric=fabric2, model=model2, opt=opt2, start=5, steps=8)
    assert losses == straight[3][5:] and scales == straight[4][5:]
    assert fresh.optimizer.num_skipped_steps == 1  # the count came with the scale
    assert torch.equal(_weights(model2), _weights(straight[1]))


def test_a_loss_scale_optimizer_set_up_with_the_plugin_is_refused_with_the_fix():
    fabric = fabric_pkg.Fabric(accelerator="cpu", devices=1, plugins=[mpl.Precision("16-mixed")])
    model = _model()
    model, opt = fabric.setup(model, mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
    x, y = _batches(1)[0]
    fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
    with pytest.raises(TypeError, match="scaled twice.*plain torch optimizer"):
        opt.step()


def test_the_unified_lightning_packages_fabric_takes_the_plugin_too():
    unified = pytest.importorskip("lightning.fabric")
    plugin = mpl.Precision("16-mixed", initial_scale=2.0**16)
    fabric = unified.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = _model()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for i, (x, y) in enumerate(_batches(4)):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss * math.inf if i == 1 else loss)
        opt.step()
        opt.zero_grad()
    assert plugin.optimizer.num_skipped_steps == 1 and plugin.scaler.get_scale() == 2.0**15
    assert torch.isfinite(_weights(model)).all()


def _two_optimizers(plugin, clip_both_first, poison=None, steps=3):
    """A generator and a discriminator from one backward each step; with `clip_both_first` both
    are clipped before either steps, else each is clipped just before its step."""
    fabric = fabric_pkg.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    gen, disc = _model(), _model()
    gen, opt_g = fabric.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.05))
    disc, opt_d = fabric.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.05))
    for i, (x, y) in enumerate(_batches(steps)):
        loss_g = torch.nn.functional.cross_entropy(gen(x), y)
        fabric.backward(torch.nn.functional.cross_entropy(disc(x), y) + (loss_g * math.inf if i == poison else loss_g))
        if clip_both_first:
            fabric.clip_gradients(disc, opt_d, max_norm=1.0, error_if_nonfinite=False)
            fabric.clip_gradients(gen, opt_g, max_norm=1.0, error_if_nonfinite=False)
            fabric.clip_gradients(gen, opt_g, max_norm=1e9, error_if_nonfinite=False)  # again: no division
        for model, opt in ((disc, opt_d), (gen, opt_g)):
            if not clip_both_first:
                fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad()
    return _weights(gen), _weights(disc), plugin.optimizer.num_skipped_steps, plugin.scaler.get_scale()


@pytest.mark.parametrize("poison", [None, 1], ids=["finite", "generator_poisoned"])
def test_two_optimizers_clipped_before_either_steps_each_step_with_their_own_gradients(poison):
    # Each optimizer's unscaled gradients wait for its own step with their own found-inf flag; the
    # first step's scale update does not touch the other's. (Fabric's own MixedPrecision unscales
    # the second optimizer's gradients again after the first step's GradScaler.update(): its
    # update comes out 65536x too small; this order was refused here before.)
    clipped_first = _two_optimizers(mpl.Precision("16-mixed"), True, poison)
    in_turn = _two_optimizers(mpl.Precision("16-mixed"), False, poison)
    for a, b in zip(clipped_first[:2], in_turn[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert clipped_first[2:] == in_turn[2:] == ((1, 2.0 ** 15) if poison is not None else (0, 2.0 ** 16))
    unclipped = _model()
    assert not torch.equal(clipped_first[0], _weights(unclipped))  # the generator trained


