"""Run by test_torch_ddp.py: two gloo ranks on CPU check the reduce-dtype DDP hook.

    python ddp_worker.py PORT

Each rank asserts; rank 0 prints one JSON line of figures at the end.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import mixedpolicy as mp


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _grads(rank, policy=None, hook=None, poison=False, plain=False, tag=None, local=False, opt=None):
    """Gradients of one DDP backward on this rank's batch (`local`: without DDP), and the
    hook state; `opt(params)` makes an optimizer whose scale_loss the backward goes through."""
    model = _model()
    if tag is not None:
        mp.apply_policy(model, tag)
    ddp = model if local else DDP(model)
    state = None
    if local:
        pass
    elif hook is not None:
        ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))  # torch's own, the reference
    elif not plain:
        state = mp.torch.register(ddp, policy)
    torch.manual_seed(rank + 1)
    x = torch.randn(32, 8)
    if poison and rank == 1:
        x[0, 0] = float("inf")
    loss = ddp(x).float().square().mean()
    optimizer = opt(model.parameters()) if opt is not None else None
    (loss if optimizer is None else optimizer.scale_loss(loss)).backward()
    return [p.grad.clone() for p in model.parameters()], state, (model if opt is None else (model, optimizer))


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    figures = {}
    plain, _, _ = _grads(rank, plain=True)
    # float32: bit for bit plain DDP
    f32, state, _ = _grads(rank, "float32")
    assert _equal(f32, plain), "float32 reduce differs from plain DDP"
    figures["float32"] = state.bytes_sent
    assert mp.torch.bytes_per_step(_model(), "float32") == state.bytes_sent  # counted before training
    # bfloat16 / float16: bit for bit torch's own compress hooks
    for name, hook in (("bfloat16", default_hooks.bf16_compress_hook), ("float16", default_hooks.fp16_compress_hook)):
        ours, state, _ = _grads(rank, mp.Policy("mixed_float16", reduce_dtype=name))
        theirs, _, _ = _grads(rank, hook=hook)
        assert _equal(ours, theirs), f"{name} reduce differs from torch's {name} compress hook"
        assert not _equal(ours, plain)
        figures[name] = state.bytes_sent
        assert mp.torch.bytes_per_step(_model(), mp.Policy("mixed_float16", reduce_dtype=name)) == state.bytes_sent
    # 8-bit: close to the float32 mean, summed in float32
    for name in ("float8_e5m2", "float8_e4m3fn"):
        ours, state, _ = _grads(rank, mp.Policy("float32", reduce_dtype=name))
        for a, b in zip(ours, plain):
            tol = 0.13 if name == "float8_e5m2" else 0.07
            assert torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max())), (name, a, b)
        figures[name] = state.bytes_sent
    # table-N: what the numpy reference decodes, summed over both ranks
    from mixedpolicy import codecs
    for bits in (1, 8):
        ours, state, model = _grads(rank, mp.Policy("float32", reduce_dtype=f"table-{bits}"))
        local = _grads(rank, plain=True, local=True)[0]
        flat = torch.cat([g.reshape(-1) for g in local]).numpy()
        both = [None, None]
        dist.all_gather_object(both, flat)
        ref = sum(codecs.decode_table(*codecs.encode_table(f, bits), bits, f.size) for f in both) / 2
        got = torch.cat([g.reshape(-1) for g in ours]).numpy()
        assert abs(got - ref).max() < 1e-5, (bits, abs(got - ref).max())
        figures[f"table-{bits}"] = state.bytes_sent
    # error feedback: over steps on the same batch, table-1's sent gradients average to the
    # true mean; without it the rounding's bias stays
    def averaged(feedback, steps=30):
        model = _model()
        ddp = DDP(model)
        mp.distributed.register(ddp, mp.Policy("float32", reduce_dtype="table-1"), error_feedback=feedback)
        torch.manual_seed(rank + 1)
        x = torch.randn(32, 8)
        total = None
        for _ in range(steps):
            model.zero_grad()
            ddp(x).float().square().mean().backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            total = flat if total is None else total + flat
        return total / steps
    truth = torch.cat([g.reshape(-1) for g in plain])
    with_ef = (averaged(True) - truth).abs().mean()
    without = (averaged(False) - truth).abs().mean()
    assert with_ef < 0.25 * without, (float(with_ef), float(without))
    figures["error_feedback"] = [float(with_ef), float(without)]
    # the study's "Fastest" as a map: by class and by glob
    fastest = mp.PolicyMap("float32", {torch.nn.Linear: mp.Policy("float32", reduce_dtype="table-1"),
                                       "*.bias": mp.Policy("float32", reduce_dtype="e5m2")})
    _, state, _ = _grads(rank, fastest)
    assert state.reduce_dtypes == {"0.weight": "table-1", "0.bias": "float8_e5m2",
                                   "2.weight": "table-1", "2.bias": "float8_e5m2"}, state.reduce_dtypes
    # per layer: layer 0 in 8 bits, the last layer in float32 exactly as plain DDP
    per_layer = mp.PolicyMap("float32", {"0": mp.Policy("float32", reduce_dtype="e5m2")})
    ours, state, _ = _grads(rank, per_layer)
    assert state.reduce_dtypes == {"0.weight": "float8_e5m2", "0.bias": "float8_e5m2",
                                   "2.weight": "float32", "2.bias": "float32"}, state.reduce_dtypes
    assert _equal(ours[2:], plain[2:]) and not _equal(ours[:2], plain[:2])
    figures["per_layer"] = state.bytes_sent
    # no policy given: the one apply_policy put on the modules
    _, state, _ = _grads(rank, tag=mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16"))
    assert set(state.reduce_dtypes.values()) == {"bfloat16"}
    # apply_policy on the DDP model: the policy on the wrapped module, the dtypes to one hook
    model = _model()
    ddp = DDP(model)
    mp.apply_policy(ddp, mp.Policy("mixed_bfloat16", reduce_dtype="e5m2"), {"2": "mixed_bfloat16"})
    state = ddp.__dict__["_mixedpolicy_reduce"]
    assert state.reduce_dtypes["0.weight"] == "float8_e5m2" and state.reduce_dtypes["2.weight"] == "float32"
    mp.apply_policy(ddp, mp.Policy("mixed_bfloat16", reduce_dtype="float16"))  # again: the same hook
    assert set(state.reduce_dtypes.values()) == {"float16"}
    assert "reduce" in str(mp.describe(ddp)) and mp.describe(ddp)[1].reduce_dtype == "float16"
    # every path describe prints is a key that reaches that layer (the wrapped module's own paths)
    rows = mp.describe(ddp)
    assert rows[0].path == "" and rows[1].path == "0", [r.path for r in rows]
    for row in rows[1:]:
        mp.apply_policy(ddp, "mixed_bfloat16", {row.path: "float32"})
        assert {r.path: r.source for r in mp.describe(ddp)}[row.path] == f"map key {row.path!r}"
    mp.apply_policy(ddp, mp.Policy("mixed_bfloat16", reduce_dtype="float16"))
    torch.manual_seed(rank + 1)
    ddp(torch.randn(4, 8)).float().sum().backward()
    assert state.buckets == 1
    mp.remove_policy(ddp)
    assert set(state.reduce_dtypes.values()) == {"float32"} and model[0].forward.__func__ is torch.nn.Linear.forward
    try:
        mp.apply_policy(DDP(_model()), "bfloat16")  # would recast parameters DDP bucketed as float32
        raise AssertionError("expected a ValueError")
    except ValueError as err:
        assert "before wrapping it in DDP" in str(err) and "Nothing was applied" in str(err), err
    # an overflow on one rank reaches every rank, in every reduce dtype: all skip together
    for name in ("float32", "bfloat16", "float16", "float8_e5m2", "float8_e4m3fn"):
        grads, _, (model, opt) = _grads(rank, mp.Policy("mixed_float16", reduce_dtype=name), poison=True, opt=lambda
                                        ps: mp.LossScaleOptimizer(torch.optim.SGD(ps, lr=0.1), policy="mixed_float16"))
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        assert opt.last_step_skipped, (rank, name)
        assert _equal([p.detach() for p in model.parameters()], before)
    # plain DDP, four steps, an overflow on rank 0 at the second: the same skips and scale
    # on both ranks, and replicas that stay equal
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(4, 2))
    opt = mp.LossScaleOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), policy="mixed_float16")
    skipped = []
    for step in range(4):
        loss = ddp(torch.randn(3, 4) + rank).square().mean()
        if step == 1 and rank == 0:
            loss = loss * float("inf")
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        skipped.append(opt.last_step_skipped)
    assert skipped == [False, True, False, False] and float(opt.loss_scale) == 2.0**14, (skipped, opt.loss_scale)
    w = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    both = [torch.zeros_like(w) for _ in range(world)]
    dist.all_gather(both, w)
    assert torch.equal(both[0], both[1]), "replicas diverged"
    dist.barrier()  # both ranks passed every check before rank 0 reports
    if rank == 0:
        print(json.dumps(figures), flush=True)
    dist.barrier()  # no rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    tmp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
