"""mixedpolicy inside a real Lightning Trainer: the precision plugin against Lightning's own
MixedPrecision on the same seeded module, automatic and manual optimization, the callback,
a LossScaleOptimizer returned from configure_optimizers, and checkpoints."""

import logging
import warnings

import pytest

from conftest import require_module

torch = require_module("torch")
pl = pytest.importorskip("pytorch_lightning")
import mixedpolicy as mp  # noqa: E402
import mixedpolicy.lightning as mpl  # noqa: E402

POISON = 3  # the training step whose loss is made infinite


@pytest.fixture(autouse=True)
def _quiet():
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Net(pl.LightningModule):
    def __init__(self, manual=False, optimizer=None, poison=POISON):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 4)
        self.automatic_optimization = not manual
        self.make_optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
        self.poison = poison
        self.losses, self.scales = [], []

    def forward(self, x):
        return self.head(self.body(x))

    def _loss(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).float(), y)
        self.losses.append(float(loss))
        return loss * float("inf") if batch_idx == self.poison else loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def _data(n=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n * 8, 16, generator=g)
    y = torch.randint(0, 4, (n * 8,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Record(pl.Callback):
    """The scale after every step, read as code written for Lightning's MixedPrecision reads it
    (its `scaler`, None where nothing is scaled): from either plugin alike."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler if hasattr(trainer.precision_plugin, "scaler") else None
        if scaler is not None:
            module.scales.append(float(scaler.get_scale()))


def _fit(module, steps=8, accelerator="cpu", **trainer_kw):
    trainer_kw.setdefault("callbacks", [])
    trainer_kw["callbacks"] = [*trainer_kw["callbacks"], Record()]
    trainer = pl.Trainer(max_steps=steps, accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
    trainer.fit(module, _data(steps))
    return trainer


def _weights(module):
    return torch.cat([p.detach().float().flatten() for p in module.parameters()])


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_16_mixed_matches_lightnings_own_plugin_losses_skips_and_scale(manual):
    theirs = Net(manual)
    # (Trainer(precision="16-mixed") turns itself into bf16-mixed on a CPU: the plugin by hand)
    _fit(theirs, plugins=[pl.plugins.precision.MixedPrecision("16-mixed", "cpu")])
    ours = Net(manual)
    trainer = _fit(ours, plugins=[mpl.Precision("16-mixed")])  # from GradScaler's start, as theirs
    plugin = trainer.precision_plugin
    assert isinstance(plugin, pl.plugins.precision.Precision) and trainer.precision == "16-mixed"
    assert ours.scales == theirs.scales and ours.scales[POISON] == ours.scales[0] / 2
    assert plugin.optimizer.num_skipped_steps == 1 and len(ours.scales) == 8
    assert trainer.scaler.get_scale() == ours.scales[-1]  # Lightning's own property reads it
    state = plugin.scaler.state_dict()  # GradScaler's format, as Lightning's plugin's scaler gives it
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert (plugin.scaler.get_growth_interval(), plugin.scaler.get_growth_factor()) == (2000, 2.0)  # its getters
    # the same steps taken: float16 compute in two orders of operations, so close, not equal
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=2e-2, atol=2e-2)
    assert torch.isfinite(_weights(ours)).all()
    table = mp.describe(ours)
    assert {row.compute_dtype for row in table if row.path == "head"} == {"float16"}


@pytest.mark.parametrize("trainer_kw", [dict(gradient_clip_val=0.5),
                                        dict(gradient_clip_val=0.05, gradient_clip_algorithm="value"),
                                        dict(accumulate_grad_batches=2, gradient_clip_val=0.5)],
                         ids=["clip-norm", "clip-value", "accumulate-and-clip"])
def test_clipping_and_accumulation_equal_lightnings_own_plugin_step_for_step(trainer_kw):
    # the Trainer clips unscaled gradients (the plugin unscales first) and steps every
    # accumulate_grad_batches batches: the same losses, weights and scales as Lightning's own
    theirs, ours = Net(), Net()
    _fit(theirs, plugins=[pl.plugins.precision.MixedPrecision("16-mixed", "cpu")], **trainer_kw)
    _fit(ours, plugins=[mpl.Precision("16-mixed")], **trainer_kw)
    assert ours.scales == theirs.scales and min(ours.scales) < max(ours.scales)  # the poisoned step backed off
    assert len(ours.losses) == len(theirs.losses)  # (equal here; close on any CPU's kernels)
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_weights(ours), _weights(theirs), rtol=1e-6, atol=1e-6)


class ClipsByHand(Net):
    """Manual optimization with Lightning's documented clip: self.clip_gradients before opt.step()."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self._loss(batch, batch_idx))
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()


def test_manual_optimizations_clip_gradients_clips_the_true_gradients_as_torchs_recipe():
    """Lightning's own MixedPrecision clips the scaled gradients in manual optimization (it
    unscales at opt.step(), after self.clip_gradients: Lightning-AI/pytorch-lightning#18089),
    so a clip to 0.5 lets through 0.5 / scale. The plugin unscales first, as torch's recipe says
    (scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_; scaler.step(opt)):
    the same weights, skipped step and scale as that recipe written by hand."""
    ours = ClipsByHand(manual=True)
    _fit(ours, plugins=[mpl.Precision("16-mixed")])
    by_hand = Net()
    opt, scaler = torch.optim.SGD(by_hand.parameters(), lr=0.1, momentum=0.9), torch.amp.GradScaler("cpu")
    scales = []
    for i, batch in enumerate(_data(8)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = by_hand._loss(batch, i)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert ours.scales == scales and min(scales) < max(scales)  # the poisoned step backed off alike
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(by_hand.losses), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(_weights(ours), _weights(by_hand), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_bf16_mixed_matches_lightnings_own_plugin_and_skips_what_it_would_apply(manual):
    theirs = Net(manual, poison=None)
    _fit(theirs, precision="bf16-mixed")
    ours = Net(manual, poison=None)
    trainer = _fit(ours, plugins=[mpl.Precision("bf16-mixed")])
    assert trainer.precision == "bf16-mixed" and trainer.precision_plugin.loss_scaling.startswith("no scaling")
    assert trainer.precision_plugin.scaler is None and ours.scales == theirs.scales == []  # as Lightning's bf16
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=3e-2, atol=3e-2)
    # an infinite loss: Lightning's bf16 plugin applies the step (the weights turn NaN); ours skips it
    theirs, ours = Net(manual), Net(manual)
    _fit(theirs, precision="bf16-mixed")
    trainer = _fit(ours, plugins=[mpl.Precision("bf16-mixed")])
    assert not torch.isfinite(_weights(theirs)).all()
    assert torch.isfinite(_weights(ours)).all() and trainer.precision_plugin.optimizer.num_skipped_steps == 1


def test_a_policy_map_on_the_trainer_reaches_the_layers_it_names_and_the_callback_logs():
    module = Net()
    callback = mpl.LossScaleCallback(every_n_steps=1)
    assert isinstance(callback, pl.Callback)
    trainer = _fit(module, plugins=[mpl.Precision(mp.PolicyMap("mixed_float16", {"head": "float32"}))],
                   callbacks=[callback])
    rows = {row.path: row for row in mp.describe(module)}
    assert rows["head"].compute_dtype == "float32" and rows["body.0"].compute_dtype == "float16"
    assert rows["body.1"].compute_dtype == "float32"  # the built-in norm rule
    logged = trainer.callback_metrics
    assert float(logged["loss_scale/skipped_steps"]) == 1.0 and float(logged["loss_scale/loss_scale"]) == 2.0**15


def test_the_scale_is_saved_in_the_trainers_checkpoint_and_resumed(tmp_path):
    module = Net()
    trainer = _fit(module, plugins=[mpl.Precision("16-mixed", initial_scale=2.0**15, dynamic_growth_steps=2)])
    scale = float(trainer.precision_plugin.optimizer.loss_scale)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    resumed = Net(poison=None)
    trainer = pl.Trainer(max_steps=9, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[mpl.Precision("16-mixed", initial_scale=2.0**15, dynamic_growth_steps=2)])
    trainer.fit(resumed, _data(9), ckpt_path=path)
    plugin = trainer.precision_plugin
    assert plugin.optimizer.num_skipped_steps == 1  # the skip of the first run came along
    assert float(plugin.optimizer.loss_scale) in (scale, scale * 2)  # one more step, growth every 2


def test_a_checkpoint_moves_between_lightnings_own_16_mixed_and_the_plugin_with_its_scale(tmp_path, caplog):
    # Lightning's MixedPrecision keeps its GradScaler's state under its own class name, the plugin
    # under its own: each resumes the other's scale (the poisoned step halved it to 2**15)
    def run(plugin, steps, ckpt=None):
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, plugins=[plugin])
        trainer.fit(Net(), _data(steps), ckpt_path=ckpt)
        trainer.save_checkpoint(tmp_path / f"{type(plugin).__name__}-{steps}.ckpt")
        return trainer.precision_plugin.scaler.get_scale(), tmp_path / f"{type(plugin).__name__}-{steps}.ckpt"

    theirs = lambda: pl.plugins.precision.MixedPrecision("16-mixed", "cpu")  # noqa: E731
    scale, path = run(theirs(), 5)
    assert scale == 2.0**15
    with caplog.at_level(logging.INFO, logger="mixedpolicy"):
        resumed, path = run(mpl.Precision("16-mixed"), 6, path)
    assert resumed == 2.0**15 and "loss scale Lightning's MixedPrecision saved" in caplog.text
    back, _ = run(theirs(), 7, path)
    assert back == 2.0**15  # (from 2**16 it would read 2**16: no step overflows after the poisoned one)


def test_a_loss_scale_optimizer_from_configure_optimizers():
    # under a policy that needs no scale it trains in Lightning's own loop (step(closure))
    module = Net(optimizer=lambda ps: mp.LossScaleOptimizer(torch.optim.SGD(ps, lr=0.1), policy="float32"))
    _fit(module)
    assert torch.isfinite(_weights(module)).all()  # the infinite step was skipped
    # under float16 scaling: Lightning's closure backpropagates the loss it returns, which the
    # wrapper's step(closure) scales (and unscales before Lightning clips), as GradScaler by hand
    module = Net(optimizer=lambda ps: mp.LossScaleOptimizer(torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                                            policy="mixed_float16", initial_scale=2.0**16))
    trainer = _fit(module, gradient_clip_val=0.5)
    by_hand = Net()
    opt = torch.optim.SGD(by_hand.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    for i, batch in enumerate(_data()):
        opt.zero_grad()
        scaler.scale(by_hand._loss(batch, i)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(by_hand.losses))  # (inf at the poisoned one)
    torch.testing.assert_close(_weights(module), _weights(by_hand))
    wrapper = trainer.optimizers[0]
    assert wrapper.num_skipped_steps == 1 and wrapper.get_scale() == scaler.get_scale() == 2.0**15
    # micro-batches backpropagated outside the step (accumulate_grad_batches) are not scaled:
    # refused, with the fix; so is manual optimization's manual_backward
    for kw, manual in (({"accumulate_grad_batches": 2}, False), ({}, True)):
        module = Net(manual=manual, optimizer=lambda ps: mp.LossScaleOptimizer(torch.optim.SGD(ps, lr=0.1),
                                                                               policy="mixed_float16"))
        with pytest.raises(RuntimeError, match="no loss was scaled.*mixedpolicy.lightning.Precision"):
            _fit(module, **kw)
    # and together with the plugin, which scales itself: refused before any step
    module = Net(optimizer=lambda ps: mp.LossScaleOptimizer(torch.optim.SGD(ps, lr=0.1)))
    with pytest.raises(TypeError, match="scales the loss itself.*plain torch optimizer"):
        _fit(module, plugins=[mpl.Precision("16-mixed")])


class SkipsOddBatches(Net):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)  # Lightning: skip it


def test_a_training_step_that_returns_none_skips_the_batch_as_with_lightnings_own_optimizer():
    """Lightning skips a batch whose training_step returns None: the closure backpropagates
    nothing, and the wrapper (a pass-through here) makes no step, as the plain SGD does."""
    plain = SkipsOddBatches(poison=-1)
    _fit(plain)
    ours = SkipsOddBatches(poison=-1, optimizer=lambda ps: mp.LossScaleOptimizer(torch.optim.SGD(
        ps, lr=0.1, momentum=0.9)))
    _fit(ours)
    assert ours.losses == plain.losses and len(ours.losses) == 4
    assert torch.equal(_weights(ours), _weights(plain))


class WithBatchNorm(Net):
    def __init__(self):
        super().__init__(poison=None)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU())

    def validation_step(self, batch, batch_idx):  # (Lightning clears the gradients before validating)
        return None


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_stochastic_weight_averaging_updates_its_batch_norms_as_under_lightnings_own_bf16(policy):
    """Lightning's StochasticWeightAveraging ends with an epoch that only recomputes the batch
    norms' statistics: the loop skips the backward, and after a validation the step has no
    gradient. The plugin
    steps nothing then (it refused the step for want of gradients to check); Lightning's own
    bf16-mixed trains through it, its own 16-mixed fails there ("No inf checks were recorded")."""
    def fit(module, **kw):
        callback = pl.callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **kw)
        trainer.fit(module, _data(4), _data(2))
        return trainer

    ours = WithBatchNorm()
    trainer = fit(ours, plugins=[mpl.Precision(policy)])
    assert trainer.precision_plugin.optimizer.num_skipped_steps == 0
    assert torch.isfinite(_weights(ours)).all() and torch.isfinite(ours.body[1].running_var).all()
    if policy == "mixed_bfloat16":
        theirs = WithBatchNorm()
        fit(theirs, precision="bf16-mixed")
        assert ours.losses == theirs.losses
        torch.testing.assert_close(_weights(ours), _weights(theirs), rtol=0, atol=0)
        torch.testing.assert_close(ours.body[1].running_mean, theirs.body[1].running_mean, rtol=0, atol=0)


def test_the_plugin_skips_a_batch_whose_training_step_returns_none_as_lightnings_own_does():
    """With clipping on: the skipped batch has no gradient to unscale or clip (it raised)."""
    theirs = SkipsOddBatches(poison=-1)
    _fit(theirs, plugins=[pl.plugins.precision.MixedPrecision("16-mixed", "cpu")], gradient_clip_val=0.5)
    ours = SkipsOddBatches(poison=-1)
    trainer = _fit(ours, plugins=[mpl.Precision("16-mixed")], gradient_clip_val=0.5)
    assert ours.scales == theirs.scales and len(ours.scales) == 8
    assert trainer.precision_plugin.optimizer.num_skipped_steps == 0  # a skipped batch is no skipped step
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=2e-2, atol=2e-2)


def test_bad_input_to_the_plugin_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="ambiguous"):
        mpl.Precision("bf16")
    with pytest.raises(TypeError, match="loss_scale=2.0 of type float.*StaticLossScale"):
        mpl.Precision("16-mixed", loss_scale=2.0)
    with pytest.raises(TypeError, match=r"together with \['initial_scale'\]"):
        mpl.Precision("16-mixed", loss_scale=mp.StaticLossScale(8.0), initial_scale=4.0)
    with pytest.raises(TypeError, match=r"together with \['dynamic_growth_steps'\]"):  # only what was given
        mpl.Precision("16-mixed", loss_scale=mp.StaticLossScale(8.0), dynamic_growth_steps=4)
    with pytest.raises(TypeError, match="Received initial_scale='big'"):  # named as given
        mpl.Precision("16-mixed", initial_scale="big")
    with pytest.raises(ValueError, match="every_n_steps=0"):
        mpl.LossScaleCallback(every_n_steps=0)
    assert mpl.Precision(32).precision == "32-true" and mpl.Precision("bf16-true").precision == "bf16-true"
    # the scale starts where Lightning's own 16-mixed (a GradScaler) starts, also with other settings given
    starts = [float(mpl.Precision(*args, **kw)._loss_scale.loss_scale) for args, kw in
              ((("16-mixed",), {}), (("mixed_float16",), dict(dynamic_growth_steps=10)),
               (("16-mixed",), dict(initial_scale=4.0)))]
    assert starts == [2.0**16, 2.0**16, 4.0]
    assert mpl.Precision("bf16-mixed").loss_scaling.startswith("no scaling")
    # what else a policy says (a reduce dtype, a recipe) leaves Lightning's name, which its summary reads
    assert mpl.Precision(mp.Policy("mixed_float16", reduce_dtype="bfloat16")).precision == "16-mixed"



@pytest.mark.parametrize("policy", ["16-true", "bf16-true"])
def test_scale_settings_under_a_pure_policy_train_its_own_half_weights(policy):
    """Scale settings make the plugin scale; the pure policy still says its half weights are its
    own (they were refused as half master weights, as LossScaleOptimizer given settings beside a
    pure policy was). Half weights the policy does not store stay refused."""
    module = Net(poison=None)
    before = _weights(Net(poison=None))
    trainer = _fit(module, steps=4, plugins=[mpl.Precision(policy, initial_scale=2.0**10)])
    assert trainer.precision_plugin.loss_scaling.startswith("dynamic")
    assert next(module.parameters()).dtype == (torch.float16 if policy == "16-true" else torch.bfloat16)
    after = _weights(module)
    assert bool(torch.isfinite(after).all()) and not torch.allclose(after, before, atol=1e-3)
    stranger = Net(poison=None).half()
    with pytest.raises(ValueError, match="master weights"):
        _fit(stranger, steps=1, plugins=[mpl.Precision("16-mixed", initial_scale=2.0**10)])

def test_the_core_callback_is_lightnings_own_where_lightning_runs():
    callback = mp.LightningLossScaleCallback(every_n_steps=1)
    assert isinstance(callback, pl.Callback) and isinstance(callback, mp.LightningLossScaleCallback)
    trainer = _fit(Net(), plugins=[mpl.Precision("16-mixed")], callbacks=[callback])
    assert float(trainer.callback_metrics["loss_scale/skipped_steps"]) == 1.0


def test_manual_optimization_with_two_optimizers_after_one_backward():
    class Two(Net):
        def training_step(self, batch, batch_idx):
            body, head = self.optimizers()
            body.zero_grad()
            head.zero_grad()
            self.manual_backward(self._loss(batch, batch_idx))
            body.step()  # one scaled backward serves both steps, as with Lightning's GradScaler
            head.step()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]

    module = Two(manual=True)
    trainer = _fit(module, plugins=[mpl.Precision("16-mixed")])
    # the poisoned step: both optimizers skip, each backing the shared scale off once
    assert trainer.precision_plugin.optimizer.num_skipped_steps == 2
    assert torch.isfinite(_weights(module)).all()


@pytest.mark.parametrize("policy, half", [("bf16-mixed", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                          (mp.PolicyMap("mixed_bfloat16", {"head": "float32"}), torch.float32)])
def test_a_training_step_that_calls_its_layers_directly_computes_as_describe_says(policy, half):
    # Lightning's own plugins run every step in their autocast; a step that skips self(x) for
    # self.body / self.head still computes under the policy, pure ones with the batch cast
    class Direct(Net):
        def _loss(self, batch, batch_idx):
            x, y = batch
            hidden = self.body(x)
            out = self.head(hidden)
            self.dtypes = (hidden.dtype, out.dtype)
            return torch.nn.functional.cross_entropy(out.float(), y)

    module = Direct(poison=None)
    _fit(module, steps=2, plugins=[mpl.Precision(policy)])
    rows = {row.path: row for row in mp.describe(module)}
    assert module.dtypes == (torch.bfloat16, half)
    assert rows["head"].compute_dtype == str(half).split(".")[1] and rows["body.0"].compute_dtype == "bfloat16"
    assert torch.isfinite(_weights(module)).all()


def test_an_update_recipe_on_the_trainer_rounds_the_optimizers_updates():
    module = Net(poison=None)
    trainer = _fit(module, steps=3, plugins=[mpl.Precision("bfloat16_stochastic")])
    inner = trainer.precision_plugin.optimizer.inner_optimizer
    assert "step" in vars(inner) and inner.param_groups[0]["stochastic_rounding_step"] == 3
    assert module.head.weight.dtype == torch.bfloat16 and torch.isfinite(_weights(module)).all()
    with pytest.raises(ValueError, match="8-bit block-quantized state is torchao's"):
        _fit(Net(poison=None), steps=1, plugins=[mpl.Precision("bfloat16_stochastic_int8")])


def test_the_unified_lightning_package_and_both_in_one_process():
    """`lightning.pytorch` (the unified package) and `pytorch_lightning` imported together:
    each Trainer takes only plugins and callbacks of its own package, so ours subclass both;
    under lightning.pytorch it matches that package's own MixedPrecision step for step."""
    L = pytest.importorskip("lightning.pytorch")
    plugin, callback = mpl.Precision("16-mixed", initial_scale=2.0**16), mpl.LossScaleCallback(every_n_steps=1)
    assert isinstance(plugin, L.plugins.precision.Precision) and isinstance(plugin, pl.plugins.precision.Precision)
    assert isinstance(callback, L.Callback) and isinstance(mp.LightningLossScaleCallback(), L.Callback)

    def module(poison=POISON):  # the same Net, a LightningModule of the unified package
        net = Net(poison=poison)
        unified = type("UnifiedNet", (L.LightningModule,), {k: getattr(Net, k) for k in (
            "forward", "_loss", "training_step", "configure_optimizers")})
        out = unified()
        out.body, out.head, out.make_optimizer, out.poison = net.body, net.head, net.make_optimizer, net.poison
        out.losses, out.scales = [], []
        return out

    def fit(m, plugin, callbacks=()):
        trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, plugins=[plugin],
                            callbacks=[*callbacks], gradient_clip_val=0.5)
        trainer.fit(m, _data(8))
        return trainer

    theirs, ours = module(), module()
    fit(theirs, L.plugins.precision.MixedPrecision("16-mixed", "cpu"))
    trainer = fit(ours, plugin, [callback])  # clipped as Lightning's own clips (its enum, not the other's)
    assert not isinstance(trainer.precision_plugin, pl.plugins.precision.Precision)  # now the module's package's
    assert trainer.scaler.get_scale() == theirs.trainer.scaler.get_scale() == 2.0**15  # backed off once
    assert float(trainer.callback_metrics["loss_scale/skipped_steps"]) == 1.0
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_weights(ours), _weights(theirs), rtol=1e-6, atol=1e-6)
    _fit(Net(), plugins=[mpl.Precision("16-mixed")], callbacks=[mpl.LossScaleCallback()])  # and the other Trainer


def test_a_forward_after_a_manual_step_in_the_same_training_step_sees_the_new_weights():
    # (a GAN's second optimizer, a look-ahead): the training step's autocast keeps no cast copies
    # of the weights, as Lightning's own does (cache_enabled=False); with the cache on, the
    # second forward ran on the half-precision copies of the weights before the step
    class TwoForwards(Net):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self._loss(batch, batch_idx))
            opt.step()
            self.after.append(self(batch[0]).detach().float())

    theirs, ours = TwoForwards(manual=True, poison=-1), TwoForwards(manual=True, poison=-1)
    theirs.after, ours.after = [], []
    _fit(theirs, steps=3, plugins=[pl.plugins.precision.MixedPrecision("bf16-mixed", "cpu")])
    _fit(ours, steps=3, plugins=[mpl.Precision("bf16-mixed")])
    assert len(ours.after) == len(theirs.after) == 3
    for a, b in zip(ours.after, theirs.after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_on_cuda_both_mixed_strings_match_lightnings_own_trainer(manual):
    # on a GPU, Trainer(precision="16-mixed") is Lightning's MixedPrecision with its own
    # GradScaler: the same losses, scales and skipped step as the plugin; bf16-mixed: the same
    # losses, and the infinite step skipped where Lightning's applies it
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    theirs, ours = Net(manual), Net(manual)
    _fit(theirs, accelerator="gpu", precision="16-mixed")
    trainer = _fit(ours, accelerator="gpu", plugins=[mpl.Precision("16-mixed")])
    assert ours.scales == theirs.scales and ours.scales[POISON] == ours.scales[0] / 2
    assert trainer.precision_plugin.optimizer.num_skipped_steps == 1
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=2e-2, atol=2e-2)
    assert trainer.strategy.root_device.type == "cuda" and torch.isfinite(_weights(ours)).all()
    theirs, ours = Net(manual), Net(manual)
    _fit(theirs, accelerator="gpu", precision="bf16-mixed")
    trainer = _fit(ours, accelerator="gpu", plugins=[mpl.Precision("bf16-mixed")])
    torch.testing.assert_close(torch.tensor(ours.losses[:POISON]), torch.tensor(theirs.losses[:POISON]),
                               rtol=3e-2, atol=3e-2)
    assert not torch.isfinite(_weights(theirs)).all()
    assert torch.isfinite(_weights(ours)).all() and trainer.precision_plugin.optimizer.num_skipped_steps == 1


@pytest.mark.parametrize("precision, half", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_lightnings_own_amp_plugin_tests_hold_for_the_plugin(precision, half):
    # tests_pytorch/plugins/precision/test_amp.py, on a module trained under the plugin: a
    # no_grad or inference_mode call inside the steps' context leaves the next call's graph
    # whole; the autocast keeps no cache of cast weights; clipping with nothing to clip is a no-op
    from unittest import mock

    module = Net()
    trainer = _fit(module, steps=1, plugins=[mpl.Precision(precision)])
    plugin = trainer.precision_plugin
    layer = module.head
    x = torch.randn(1, 32)
    for context in (torch.no_grad, torch.inference_mode):
        with plugin.forward_context():
            with context():
                layer(x)
            loss = layer(x).float().mean()
        loss.backward()
        assert loss.grad_fn is not None
    with plugin.autocast_context_manager():
        assert not torch.is_autocast_cache_enabled() and torch.get_autocast_dtype("cpu") == half
        assert layer(x).dtype == half
    plugin.clip_grad_by_value, plugin.clip_grad_by_norm = mock.Mock(), mock.Mock()
    plugin.clip_gradients(mock.Mock(spec=torch.optim.Optimizer))
    assert not plugin.clip_grad_by_value.called and not plugin.clip_grad_by_norm.called
    # before the plugin has a module: the policy's own autocast, on the CPU here
    with mpl.Precision(precision).autocast_context_manager():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == half


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("bf16-mixed", torch.float32),
                                              ("16-mixed", torch.float32), ("bf16-true", torch.bfloat16),
                                              ("16-true", torch.float16)])
def test_init_module_makes_weights_in_the_dtype_lightnings_own_plugins_make_them(precision, dtype):
    # Lightning's own test_module_init_context: under a pure policy, trainer.init_module() makes
    # the weights in half precision from the start (no float32 copy first); once the Trainer
    # converts the module, what the policy keeps in float32 (the norm) is float32 again
    plugin = mpl.Precision(precision)
    for context in (plugin.module_init_context, plugin.tensor_init_context):
        with context():
            assert torch.get_default_dtype() == dtype
            layer = torch.nn.Linear(2, 2)
        assert layer.weight.dtype == dtype and torch.get_default_dtype() == torch.float32
    trainer = pl.Trainer(plugins=[plugin], accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with plugin.forward_context():  # Lightning's own test_forward_context: tensors made in a step
        assert torch.get_default_dtype() == dtype
    assert torch.get_default_dtype() == torch.float32
    with trainer.init_module():
        module = Net(poison=None)
    assert module.head.weight.dtype == dtype and module.body[1].weight.dtype == dtype
    trainer.fit(module, _data())
    assert module.head.weight.dtype == dtype and module.body[1].weight.dtype == torch.float32  # the LayerNorm
    assert torch.isfinite(_weights(module)).all() and plugin.optimizer.num_skipped_steps == 0


def test_under_fsdp_strategy_ranks_skip_together_as_by_hand_with_sharded_grad_scaler():
    """Lightning's FSDPStrategy takes the plugin (a subclass of its FSDPPrecision) on two gloo
    ranks: an overflow in one rank's shard makes both skip and back off together, norm clipping
    runs over every rank's shards, and the weights are bit for bit those of the same model and
    batches trained by hand with FSDP and torch's ShardedGradScaler; a policy FSDP cannot carry
    out is refused before wrapping, the module given back as it was; Fabric's FSDPStrategy alike;
    ModelParallelStrategy (FSDP2) skips together (lightning_fsdp_worker.py)."""
    from test_torch_distributed import _report

    assert _report("lightning_fsdp_worker.py") == {"ok": True}
    assert issubclass(mpl.Precision, pl.plugins.precision.FSDPPrecision)


class _Encoder(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.encoder, self.head = torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(32, 3)

    def forward(self, x, pad):
        return self.head(self.encoder(x, src_key_padding_mask=pad)[:, 0])

    def training_step(self, batch, batch_idx):
        x, pad, y = batch
        return torch.nn.functional.cross_entropy(self(x, pad).float(), y)

    def validation_step(self, batch, batch_idx):
        x, pad, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x, pad).float(), y))

    def predict_step(self, batch, batch_idx):
        return self.encoder(batch[0], src_key_padding_mask=batch[1])  # a submodule called directly

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16"])
def test_a_transformer_encoder_validates_and_predicts_under_the_plugin(policy):
    """Validation and prediction run in eval mode without gradients, where torch's fused
    attention kernel (its "fastpath") failed on a half-precision autocast on the CPU (Lightning's
    own bf16-mixed fails there too: Lightning-AI/pytorch-lightning#19980): under the plugin the
    encoder computes module by module, the steps' own calls into it included, and torch's
    setting is put back."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 8, 32, generator=g)
    pad = torch.zeros(16, 8, dtype=torch.bool)
    pad[::2, 6:] = True
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, pad, torch.randint(0, 3, (16,), generator=g)),
                                       batch_size=4)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
                         plugins=[mpl.Precision(policy)])
    module = _Encoder()
    trainer.fit(module, data, data)
    predicted = trainer.predict(module, data)
    assert torch.backends.mha.get_fastpath_enabled()
    module.eval()
    with torch.no_grad():  # called from outside the trainer, the encoder runs its policy's region
        expected = module.encoder(x[:4], src_key_padding_mask=pad[:4])
    kept = ~pad[:4]
    assert predicted[0].dtype == expected.dtype
    torch.testing.assert_close(predicted[0][kept], expected[kept], rtol=0, atol=0)
