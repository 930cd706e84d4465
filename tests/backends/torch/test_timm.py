"""timm's models (small configs, random weights, nothing downloaded) under mixedpolicy: they compute
as torch's own autocast does and as describe says, overrides by path, glob and timm's own classes
reach the layers they name, training matches autocast + GradScaler step for step (skipped steps and
scale included), checkpoints resume bit for bit, and a Lightning Trainer runs them."""

import copy
import logging
import warnings

import pytest

from conftest import require_module
from zoo_helper import import_timm

torch = require_module("torch")
try:
    timm = import_timm()
except ImportError as err:
    pytest.skip(str(err), allow_module_level=True)
import mixedpolicy as mp  # noqa: E402

SIZE = 32
MODELS = {
    # BatchNorm, a deep stem, global pooling
    "resnet10t": {},
    # LayerNorm, fused attention, a class token, the head named "head"
    "vit_tiny_patch16_224": {"img_size": SIZE, "patch_size": 8, "depth": 2},
    # timm's own LayerNorm2d (a subclass of nn.LayerNorm), depthwise convolutions, layer scale
    "convnext_atto": {},
}


def _model(name, seed=0):
    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False, num_classes=10, **MODELS[name])


def _batch(i=0, n=4):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 3, SIZE, SIZE, generator=g), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_timm_model_computes_as_autocast_does_and_as_describe_says(name, half):
    plain = _model(name).eval()
    ours = mp.apply_policy(copy.deepcopy(plain), "mixed_float16" if half == torch.float16 else "mixed_bfloat16")
    x, _ = _batch()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=half):
            expected = plain(x)
        got = ours(x)
    assert got.dtype == expected.dtype == half
    assert torch.equal(got, expected)
    with torch.no_grad():  # timm's own entry points beside forward: the stages' policies hold there too
        with torch.autocast("cpu", dtype=half):
            features = plain.forward_features(x)
        assert torch.equal(ours.forward_features(x), features)
    outputs = {}
    for path, module in ours.named_modules():
        module.register_forward_hook(lambda m, i, o, path=path: outputs.__setitem__(path, o))
    with torch.no_grad():
        ours(x)
    rows = {row.path: row for row in mp.describe(ours)}
    assert all(p.dtype == torch.float32 for p in ours.parameters())  # float32 masters
    for path, module in ours.named_modules():
        out = outputs.get(path)
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and isinstance(out, torch.Tensor):
            assert out.dtype == half and rows[path or "(root)"].compute_dtype == str(half).split(".")[1], path
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.modules.batchnorm._BatchNorm)):
            assert rows[path].compute_dtype == "float32" and rows[path].source == "built-in rule: normalization"


@pytest.mark.parametrize("name, overrides, expect_float32", [
    ("vit_tiny_patch16_224", {"head": "float32", "blocks.*.mlp.fc2": "float32"},
     ["head", "blocks.0.mlp.fc2", "blocks.1.mlp.fc2"]),
    ("vit_tiny_patch16_224", "attention class", ["blocks.0.attn", "blocks.1.attn"]),
    ("convnext_atto", {"stages.0.*": "float32"}, ["stages.0.blocks.0.conv_dw", "stages.0.blocks.1.mlp.fc1"]),
])
def test_overrides_by_path_glob_and_timms_own_classes_reach_the_layers_they_name(name, overrides, expect_float32):
    if overrides == "attention class":
        overrides = {timm.models.vision_transformer.Attention: "float32"}
    model = mp.apply_policy(_model(name).eval(), "mixed_bfloat16", overrides)
    outputs = {}
    for path, module in model.named_modules():
        module.register_forward_hook(lambda m, i, o, path=path: outputs.__setitem__(path, o))
    with torch.no_grad():
        model(_batch()[0])
    rows = {row.path: row for row in mp.describe(model)}
    for path in expect_float32:
        assert rows[path].compute_dtype == "float32" and outputs[path].dtype == torch.float32, path
        assert rows[path].source != "map default", path
    # every path describe prints pastes back as a key that names that layer
    for path in [p for p in rows if p != "(root)"][::7]:
        again = mp.apply_policy(_model(name).eval(), "mixed_bfloat16", {path: "float32"})
        assert {row.path: row for row in mp.describe(again)}[path].source == f"map key {path!r}"


def _train_ours(name, steps, poison, model=None, opt=None, start=0):
    model = model or mp.apply_policy(_model(name), "mixed_float16")
    opt = opt or mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses, scales = [], []
    for i in range(start, start + steps):
        x, y = _batch(i)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        losses.append(float(loss))
        opt.scale_loss(loss * float("inf") if i == poison else loss).backward()
        opt.step()
        opt.zero_grad()
        scales.append(float(opt.loss_scale))
    return model, opt, losses, scales


@pytest.mark.parametrize("name", ["resnet10t", "vit_tiny_patch16_224"])
def test_training_matches_autocast_and_grad_scaler_step_for_step(name):
    model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    losses, scales = [], []
    for i in range(5):
        x, y = _batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        losses.append(float(loss))
        scaler.scale(loss * float("inf") if i == 2 else loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
    ours, opt, our_losses, our_scales = _train_ours(name, 5, poison=2)
    assert our_scales == scales and scales[2] == scales[1] / 2  # the poisoned step skipped by both
    assert opt.num_skipped_steps == 1
    # float16 compute in the same kernels; AdamW's update order may differ in the last bit
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(losses), rtol=1e-3, atol=1e-3)
    assert all(torch.isfinite(p).all() for p in ours.parameters())


def test_a_checkpoint_resumes_bit_for_bit(tmp_path):
    name = "resnet10t"
    _, _, straight, straight_scales = _train_ours(name, 5, poison=1)
    model, opt, _, _ = _train_ours(name, 3, poison=1)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model = mp.apply_policy(_model(name, seed=1), "mixed_float16")  # other weights: the load must replace them
    model.load_state_dict(state["model"])
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    opt.load_state_dict(state["opt"])
    _, _, resumed, resumed_scales = _train_ours(name, 2, poison=1, model=model, opt=opt, start=3)
    assert resumed == straight[3:] and resumed_scales == straight_scales[3:]


def test_a_timm_model_in_a_lightning_trainer_matches_lightnings_own_plugin():
    pl = pytest.importorskip("pytorch_lightning")
    import mixedpolicy.lightning as mpl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model("vit_tiny_patch16_224")
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x).float(), y)
            self.losses.append(float(loss))
            return loss * float("inf") if batch_idx == 1 else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    batches = [_batch(i) for i in range(4)]
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat([b[0] for b in batches]),
                                                                      torch.cat([b[1] for b in batches])),
                                       batch_size=4)
    runs = []
    for plugin in (pl.plugins.precision.MixedPrecision("16-mixed", "cpu"), mpl.Precision("16-mixed",
                                                                                           initial_scale=2.0**16)):
        module = Module()
        for logger in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
            logging.getLogger(logger).setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, plugins=[plugin]).fit(module, data)
        runs.append(module)
    theirs, ours = runs
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-3, atol=1e-3)
    assert {row.compute_dtype for row in mp.describe(ours.net) if row.path == "head"} == {"float16"}
    assert all(torch.isfinite(p).all() for p in ours.parameters())
