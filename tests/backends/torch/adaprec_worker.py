"""Run by test_torch_distributed.py: mp.AdaPrec around a DDP training loop on two gloo ranks.

    python adaprec_worker.py PORT

The training state is live (a module and an optimizer), so AdaPrec gets snapshot= and
restore= (state dicts, copied); each step sets the DDP hook's reduce dtype to the choice
and returns the loss averaged over the ranks, so both ranks see the same curves and, with a
fixed compute_seconds, make the same decisions. Each rank asserts; rank 0 prints one JSON
line at the end.
"""

import copy
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import mixedpolicy as mp
from mixedpolicy.codecs import wire_bytes

CANDIDATES = ("float32", "float8_e5m2", "table-1")


def setup(rank):
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ddp = DDP(model)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy="mixed_float16")
    rng = np.random.default_rng(0)
    order = np.concatenate([rng.permutation(len(x))[:28 * 64] for _ in range(3)]).reshape(-1, 64)[:60]
    batches = [order[i][rank * 32:(rank + 1) * 32] for i in range(60)]              # this rank's half

    def train_step(state, idx, choice):
        mp.distributed.register(ddp, mp.Policy("float32", reduce_dtype=choice))  # the hook's dtype
        loss = torch.nn.functional.cross_entropy(ddp(x[idx]).float(), y[idx])
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return state, float(mean) / dist.get_world_size()

    def snapshot(state):
        return copy.deepcopy((model.state_dict(), opt.state_dict()))

    def restore(saved):
        model.load_state_dict(saved[0])
        opt.load_state_dict(copy.deepcopy(saved[1]))
        return None

    def bytes_per_step(choice):
        return sum(wire_bytes(p.numel(), choice) for p in model.parameters())

    def accuracy():
        with torch.no_grad():
            return float((model(x).argmax(1) == y).float().mean())

    return model, opt, batches, train_step, snapshot, restore, bytes_per_step, accuracy


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # speculation leaves no trace on live objects: with float32 the only candidate, the run
    # is bit for bit the plain float32 DDP run on the same batches
    model, _, batches, train_step, snapshot, restore, bytes_per_step, _ = setup(rank)
    for idx in batches[:20]:
        train_step(None, idx, "float32")
    plain = weights(model)
    model, _, batches, train_step, snapshot, restore, bytes_per_step, _ = setup(rank)
    only = mp.AdaPrec(["float32"], speculative_steps=3, interval=5, bytes_per_step=bytes_per_step,
                      compute_seconds=1e-3, snapshot=snapshot, restore=restore)
    for _ in only.run(None, batches[:20], train_step):
        pass
    assert torch.equal(weights(model), plain), "speculation changed the float32 run"
    # three candidates on a slow link: both ranks decide alike, the replicas stay equal, it learns
    model, opt, batches, train_step, snapshot, restore, bytes_per_step, accuracy = setup(rank)
    ada = mp.AdaPrec(CANDIDATES, speculative_steps=3, interval=15, bytes_per_step=bytes_per_step,
                     bandwidth="10MB/s", compute_seconds=1e-3, snapshot=snapshot, restore=restore)
    chosen = [choice for _, _, _, choice in ada.run(None, batches, train_step)]
    decisions = [(d.step, d.choice) for d in ada.decisions]
    both = [None, None]
    dist.all_gather_object(both, decisions)
    assert both[0] == both[1], both
    w = weights(model)
    replicas = [torch.zeros_like(w) for _ in range(world)]
    dist.all_gather(replicas, w)
    assert torch.equal(replicas[0], replicas[1]), "replicas diverged"
    sent = sum(map(bytes_per_step, chosen))
    assert sent < 0.6 * len(chosen) * bytes_per_step("float32"), (decisions, sent)
    assert accuracy() > 0.85, (accuracy(), decisions, ada.rollbacks)
    dist.barrier()
    if rank == 0:
        print(json.dumps({"decisions": decisions, "rollbacks": ada.rollbacks, "accuracy": accuracy(),
                          "bytes_vs_float32": sent / (len(chosen) * bytes_per_step("float32"))}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    tmp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
