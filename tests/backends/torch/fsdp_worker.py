"""Run by test_torch_distributed.py: two gloo ranks on CPU shard a model with FSDP2
(``fully_shard``) under ``Policy.to_fsdp()``, and with FSDP (``FullyShardedDataParallel``)
against torch's ``ShardedGradScaler``.

    python fsdp_worker.py PORT

Each rank asserts; rank 0 prints {"ok": true} once both passed.
"""

import contextlib
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import mixedpolicy as mp


def _refused(error, call, *said):
    """Asserts `call()` raises `error` whose message says each of `said`."""
    try:
        call()
    except error as err:
        assert all(part in str(err) for part in said), err
    else:
        raise AssertionError(f"not refused; expected {error.__name__} saying {said}")


def _sharded(mp_policy, model=None):
    torch.manual_seed(0)
    if model is None:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    else:
        model = copy.deepcopy(model)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _train(model, rank, poison_step=None, steps=3):
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy="mixed_float16")
    skipped = []
    for step in range(steps):
        torch.manual_seed(100 * step + rank)
        out = model(torch.randn(4, 8))
        opt.scale_loss(out.float().square().mean()).backward()
        if step == poison_step and rank == 1:
            model[0].weight.grad.to_local()[0, 0] = float("inf")  # one rank's shard only
        opt.step()
        opt.zero_grad()
        skipped.append(opt.last_step_skipped)
    return skipped, out, opt


def _policy_on_a_sharded_model():
    """apply_policy after fully_shard: a mixed policy, per-layer overrides included, computes as
    on the unsharded model (the regions run around FSDP's gathered parameters); one that would
    store parameters in another dtype is refused, the policy the model had kept."""
    torch.manual_seed(0)  # the same weights on both ranks: each keeps its shard of them
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    sharded = _sharded(None, plain)
    rules = mp.PolicyMap("mixed_bfloat16", {"2": "float32"})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for policy in ("mixed_bfloat16", rules):
        mp.apply_policy(sharded, policy)
        mp.apply_policy(plain, policy)
        assert torch.equal(sharded(x), plain(x)), policy
        assert [r.policy for r in mp.describe(sharded)] == [r.policy for r in mp.describe(plain)]
    sharded(x).float().sum().backward()
    assert all(p.grad.dtype == torch.float32 and type(p.grad).__name__ == "DTensor" for p in sharded.parameters())
    mp.apply_policy(sharded, rules)  # after a step, the root's gathered parameters still registered
    _refused(ValueError, lambda: mp.apply_policy(sharded, "bfloat16"), "sharded by FSDP2", "before fully_shard")
    assert mp.describe(sharded)[3].policy == mp.Policy("float32") and sharded(x).dtype == torch.float32
    # a float32 override inside a unit whose mp_policy gathers bfloat16: refused up front (torch
    # failed at the layer's first matmul); a mixed policy there runs
    gathering = _sharded(MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    _refused(ValueError, lambda: mp.apply_policy(gathering, rules), "gathers 2.weight in bfloat16", "unit of its own")
    assert mp.apply_policy(gathering, "mixed_bfloat16")(x).dtype == torch.bfloat16
    # the same policy applied before fully_shard: said at the first call, with the fix
    torch.manual_seed(0)
    early = _sharded(MixedPrecisionPolicy(torch.bfloat16, torch.float32), mp.apply_policy(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)), rules))
    _refused(RuntimeError, lambda: early(x), "its weight 'weight' is bfloat16 at this call", "unit of its own")


def _fsdp1_train(rank, ours, use_orig_params):
    """Five steps of an FSDP-wrapped model under mixed_float16, ours or autocast with torch's
    ShardedGradScaler; at step 2 one value of rank 1's gradient shard is made inf."""
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)),
        use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if ours:
        mp.apply_policy(model, "mixed_float16")
        opt = mp.LossScaleOptimizer(sgd, policy="mixed_float16")
    else:
        scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 15)  # the policy's starting scale
    trace = []
    for step in range(5):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(4, 8)
        with contextlib.nullcontext() if ours else torch.autocast("cpu", torch.float16):
            loss = model(x).float().square().mean()
        (opt.scale_loss(loss) if ours else scaler.scale(loss)).backward()
        if step == 2 and rank == 1:
            next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
        if ours:
            opt.step()
            trace.append((loss.item(), opt.loss_scale.item()))
        else:
            scaler.step(sgd)
            scaler.update()
            trace.append((loss.item(), scaler.get_scale()))
        sgd.zero_grad()
    return trace, [p.detach().clone() for p in model.parameters()]


def _fsdp1_skips_as_sharded_grad_scaler(rank):
    """FSDP (not FSDP2) leaves each rank its shard of the gradients as plain tensors: an inf in
    one rank's shard makes every rank skip and back off, as torch's ShardedGradScaler makes
    them; the same losses, scales and weight shards bit for bit."""
    for use_orig_params in (False, True):
        ours, ours_weights = _fsdp1_train(rank, True, use_orig_params)
        theirs, their_weights = _fsdp1_train(rank, False, use_orig_params)
        assert ours == theirs, (rank, use_orig_params, ours, theirs)
        assert ours[2][1] == ours[1][1] / 2, ours  # the poisoned step backed off on both ranks
        assert all(torch.equal(a, b) for a, b in zip(ours_weights, their_weights)), (rank, use_orig_params)
        # a pure policy cannot change the dtype of what FSDP flattened: refused up front, the
        # mixed policy the model had kept (it failed at the first call, inside torch)
        wrapped = FullyShardedDataParallel(mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(8, 4)), "mixed_float16"),
                                           use_orig_params=use_orig_params, device_id=torch.device("cpu"))
        _refused(ValueError, lambda: mp.apply_policy(wrapped, "bfloat16"),
                 "wrapped in FSDP's FullyShardedDataParallel", "before wrapping")
        assert [r.policy for r in mp.describe(wrapped)] == [mp.Policy("mixed_float16")] * 2
        assert wrapped(torch.randn(2, 8)).dtype == torch.float16


def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # to_fsdp is the MixedPrecisionPolicy one would write by hand, and trains the same
    for policy, by_hand in (
            (mp.Policy("mixed_bfloat16"), MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
            (mp.Policy("mixed_float16", reduce_dtype="float16"), MixedPrecisionPolicy(torch.float16, torch.float16))):
        assert policy.to_fsdp() == by_hand, (policy.to_fsdp(), by_hand)
        ours, theirs = _sharded(policy.to_fsdp()), _sharded(by_hand)
        _, out, _ = _train(ours, rank)
        _train(theirs, rank)
        assert out.dtype == getattr(torch, policy.compute_dtype)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert a.dtype == torch.float32 and torch.equal(a.to_local(), b.to_local())
    # an overflow in one rank's shard makes every rank skip (the scale backs off on both)
    skipped, _, opt = _train(_sharded(mp.Policy("mixed_float16").to_fsdp()), rank, poison_step=1)
    assert skipped[1] and not skipped[2], (rank, skipped)
    scale = torch.tensor([float(opt.loss_scale)])
    both = [torch.zeros(1), torch.zeros(1)]
    dist.all_gather(both, scale)
    assert torch.equal(both[0], both[1]), both
    _policy_on_a_sharded_model()
    _fsdp1_skips_as_sharded_grad_scaler(rank)
    dist.barrier()
    if rank == 0:
        print(json.dumps({"ok": True}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    tmp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
