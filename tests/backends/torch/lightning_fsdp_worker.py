"""Run by test_lightning.py: Lightning's ``FSDPStrategy`` on two gloo ranks (CPU) with
``mixedpolicy.lightning.Precision``, against the same model and batches trained by hand under
``FullyShardedDataParallel`` with torch's ``ShardedGradScaler``.

    python lightning_fsdp_worker.py PORT

Lightning starts rank 1 itself (it runs this script again with ``LOCAL_RANK=1``). Each rank
asserts; rank 0 prints {"ok": true} once both passed.
"""

import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", sys.argv[1])
torch.set_num_threads(1)

import lightning_fabric  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

import mixedpolicy as mp  # noqa: E402
import mixedpolicy.lightning as mpl  # noqa: E402

STEPS, BATCH, POISON = 5, 4, 2
POLICY = mp.PolicyMap("16-mixed", {"net.3": "float32"})


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on the CPU, for this test only: Lightning refuses FSDP without a
    GPU, and hands FSDP the device index (None on a CPU), where FSDP on a CPU wants the device.
    Everything else (the plugin it takes, convert_module before wrapping, the MixedPrecision it
    reads from the plugin) is the strategy's own."""

    def _setup_model(self, model):
        return FullyShardedDataParallel(model, mixed_precision=self.mixed_precision_config,
                                        device_id=torch.device("cpu"), **self.kwargs)


class ByHandFSDPStrategy(CPUFSDPStrategy):
    """Submodules wrapped by hand, the root left unwrapped (what configure_sharded_model gives)."""

    def _setup_model(self, model):
        model.net[0] = FullyShardedDataParallel(model.net[0], device_id=torch.device("cpu"), use_orig_params=True)
        return model


class CPUFabricFSDPStrategy(lightning_fabric.strategies.FSDPStrategy):
    """Fabric's FSDPStrategy on the CPU, for this test only, as `CPUFSDPStrategy`."""

    def setup_module(self, module):
        return FullyShardedDataParallel(module, mixed_precision=self.mixed_precision_config,
                                        device_id=torch.device("cpu"), **self._fsdp_kwargs)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def _loss(net, x, y, batch_idx, rank):
    loss = torch.nn.functional.cross_entropy(net(x).float(), y)
    if batch_idx == POISON and rank == 0:  # an inf in the last bias alone: it lies in rank 1's shard
        loss = loss + float("inf") * net[3].bias.sum()
    return loss


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _net()

    def training_step(self, batch, batch_idx):
        return _loss(self.net, *batch, batch_idx, self.global_rank)

    def configure_optimizers(self):
        return torch.optim.SGD(self.trainer.model.parameters(), lr=0.5)


class Sharded2(Module):
    """FSDP2 (`fully_shard` in configure_model), as Lightning's ModelParallelStrategy runs it; an
    inf in rank 1's shard of the first weight's gradient alone at step POISON."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3], self.net):
            fully_shard(layer, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]).float(), batch[1])

    def on_after_backward(self):
        if self.global_step == POISON and self.global_rank == 1:
            self.net[0].weight.grad.to_local()[0, 0] = float("inf")


def _row(module, path):
    return next(row for row in mp.describe(module) if row.path == path)


def _loader():
    """This rank's batches, in order (the Trainer is told to keep this sampler): rank 0 is the
    process started by hand, rank 1 the one Lightning starts with LOCAL_RANK=1."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * STEPS * BATCH, 8, generator=g), torch.randint(0, 4, (2 * STEPS * BATCH,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=int(os.environ.get("LOCAL_RANK", 0)),
                                                  shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)


class _Step(torch.nn.Module):
    """The loss inside the FSDP root's forward, where its parameters are gathered, as Lightning
    runs training_step."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y, batch_idx, rank):
        return _loss(self.net, x, y, batch_idx, rank)


def _trainer(plugin, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(**kwargs), plugins=[plugin],
                      max_steps=STEPS, gradient_clip_val=1.0, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def _by_hand(rank, kwargs):
    """The same model and batches, by hand: the policy, FSDP, GradScaler's start, FSDP's clipping
    by the norm over the shards, ShardedGradScaler."""
    net = _net()
    model = FullyShardedDataParallel(mp.apply_policy(_Step(net), POLICY), device_id=torch.device("cpu"), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = ShardedGradScaler("cpu")
    for batch_idx, (x, y) in enumerate(_loader()):
        scaler.scale(model(x, y, batch_idx, rank)).backward()
        scaler.unscale_(opt)
        model.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    with FullyShardedDataParallel.summon_full_params(model):
        return [p.detach().clone() for p in net.parameters()], scaler.get_scale()


def main():
    module, plugin = Module(), mpl.Precision(POLICY)
    trainer = _trainer(plugin)
    trainer.fit(module, _loader())
    rank = trainer.global_rank
    assert isinstance(trainer.strategy.model, FullyShardedDataParallel), type(trainer.strategy.model)
    assert trainer.strategy.mixed_precision_config.reduce_dtype is None  # float32, as stored
    opt = plugin.optimizer
    # the inf lay in rank 1's shard only, yet both ranks skipped that step and backed off once
    assert opt.num_skipped_steps == 1 and float(opt.loss_scale) == 2.0**15, (rank, opt.num_skipped_steps,
                                                                               opt.loss_scale)
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
        ours = [p.detach().clone() for p in module.net.parameters()]
    theirs, scale = _by_hand(rank, trainer.strategy.kwargs)  # (Lightning's: the original parameters)
    assert scale == 2.0**15, scale
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), (rank, (a - b).abs().max())
    assert _row(module, "net.3").compute_dtype == "float32"
    # the checkpoint holds the scale where Lightning's FSDPPrecision keeps its ShardedGradScaler's
    # (the hooks the Trainer calls; FSDP's optimizer state_dict crashes gloo on a CPU, Lightning's
    # own plugin too, so trainer.save_checkpoint is not run here)
    saved = {"Precision": plugin.state_dict()}
    plugin.on_save_checkpoint(saved)
    assert saved["FSDPPrecision"]["scale"] == saved["Precision"]["scale"] == 2.0**15, saved

    # Fabric's FSDPStrategy (litgpt's loop): the same weights, both ranks skipping together
    plugin = mpl.Precision(POLICY)
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy=CPUFabricFSDPStrategy(), plugins=[plugin])
    fabric.launch()
    net = _net()
    model = fabric.setup_module(_Step(net))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    for batch_idx, (x, y) in enumerate(_loader()):
        fabric.backward(model(x, y, batch_idx, rank))
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()
    assert plugin.optimizer.num_skipped_steps == 1 and float(plugin.optimizer.loss_scale) == 2.0**15
    with FullyShardedDataParallel.summon_full_params(model._forward_module):
        fabrics = [p.detach().clone() for p in net.parameters()]
    theirs, _ = _by_hand(rank, fabric.strategy._fsdp_kwargs)
    for a, b in zip(fabrics, theirs):
        assert torch.equal(a, b), (rank, (a - b).abs().max())
    # Fabric hands the plugin its optimizer at the first step: a reduce dtype FSDP cannot carry is
    # refused there, before any update
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy=CPUFabricFSDPStrategy(),
                                     plugins=[mpl.Precision(mp.Policy("mixed_bfloat16", reduce_dtype="float8_e5m2"))])
    fabric.launch()
    model = fabric.setup_module(_Step(_net()))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = next(iter(_loader()))
    fabric.backward(model(x, y, 0, rank))
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except ValueError as err:
        assert "DDPStrategy" in str(err), err
    else:
        raise AssertionError("an 8-bit reduce dtype not refused under Fabric's FSDPStrategy")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    # bf16 gradients through FSDP's reduce-scatter where the policy says so: it trains, nothing scaled
    bf16, module = mpl.Precision(mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16")), Module()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = _trainer(bf16)
    trainer.fit(module, _loader())
    assert trainer.strategy.model.mixed_precision.reduce_dtype == torch.bfloat16
    assert bf16.scaler is None and bf16.optimizer.num_skipped_steps == 1  # the inf step, skipped unscaled
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
        after = [p.detach().clone() for p in module.parameters()]
    assert all(torch.isfinite(a).all() and not torch.equal(a, b) for a, b in zip(after, before))

    # what FSDP cannot carry out is refused before wrapping, the module given back as it was
    for policy, said in (("bf16-true", "auto_wrap_policy"),
                         (mp.PolicyMap(mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16"), {"net.3": "float32"}),
                          "reduce_dtype='bfloat16'"),
                         (mp.Policy("mixed_bfloat16", reduce_dtype="float8_e5m2"), "DDPStrategy")):
        module = Module()
        before = [p.detach().clone() for p in module.parameters()]
        try:
            _trainer(mpl.Precision(policy)).fit(module, _loader())
        except ValueError as err:
            assert said in str(err), err
        else:
            raise AssertionError(f"{policy} not refused under FSDPStrategy")
        assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
        assert _row(module, "net.0").source == "no policy applied"

    # norm clipping with a root FSDP does not wrap: each rank would clip by its own shards' norm
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ByHandFSDPStrategy(use_orig_params=True),
                         plugins=[mpl.Precision("bf16-mixed")], max_steps=1, gradient_clip_val=1.0,
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Module(), _loader())
    except ValueError as err:
        assert "not FullyShardedDataParallel" in str(err) and "gradient_clip_algorithm='value'" in str(err), err
    else:
        raise AssertionError("norm clipping under a root FSDP does not wrap was not refused")

    # ModelParallelStrategy (FSDP2 applied in configure_model, before the plugin's policy): both
    # ranks skip together, the policy computes per layer as describe says
    module, plugin = Sharded2(), mpl.Precision(POLICY)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(2, 1), plugins=[plugin],
                         max_steps=STEPS, gradient_clip_val=1.0, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _loader())
    assert plugin.optimizer.num_skipped_steps == 1 and float(plugin.optimizer.loss_scale) == 2.0**15
    assert _row(module, "net.3").compute_dtype == "float32" and _row(module, "net.0").compute_dtype == "float16"
    assert all(torch.isfinite(p.full_tensor()).all() for p in module.parameters())

    done = torch.ones(1)
    dist.all_reduce(done)  # both ranks got here
    if rank == 0 and math.isclose(float(done), 2.0):
        print('{"ok": true}', flush=True)


if __name__ == "__main__":
    main()
