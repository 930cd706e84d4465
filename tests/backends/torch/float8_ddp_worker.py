"""Run by test_torch_distributed.py: two gloo ranks on CPU train a delayed-fp8 layer under DDP.

    python float8_ddp_worker.py PORT

Each rank feeds its own batches (different amaxes). Rank 0 prints one JSON line once both
ranks agree: the same scales and histories on both ranks, the inputs' history holding the
largest amax over the ranks, the replicas' weights equal.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.nn.parallel import DistributedDataParallel as DDP

import mixedpolicy as mp

_BUFFERS = ("input_scale", "input_amax_history", "weight_scale", "weight_amax_history",
            "grad_scale", "grad_amax_history")


def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    fp8 = mp.Policy("float32", float8_recipe="delayed", amax_history_len=4)
    mp.apply_policy(model, mp.PolicyMap(fp8, {"0": fp8}))  # a key: the rules keep the head out
    layer = model[0]
    # no buffer sync in forward: the histories agree because the amaxes are reduced, not because
    # DDP copies rank 0's buffers over the others' before each forward
    ddp = DDP(model, forward_sync_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    local_amaxes = []
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(8, 16) * (1 + 3 * rank) * (step + 1)  # rank 1's inputs larger
        local_amaxes.append(float(x.abs().max()))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    mine = {name: getattr(layer, name).clone() for name in _BUFFERS}
    mine["weight"] = layer.weight.detach().clone()
    gathered = [None] * world
    dist.all_gather_object(gathered, {"buffers": {k: v.tolist() for k, v in mine.items()},
                                      "amaxes": local_amaxes})
    if rank == 0:
        a, b = (g["buffers"] for g in gathered)
        for name in (*_BUFFERS, "weight"):
            assert a[name] == b[name], (name, a[name], b[name])
        largest = [max(g["amaxes"][i] for g in gathered) for i in range(3)]
        history = a["input_amax_history"]  # newest at index 0, then the older ones rolled to the end
        assert history[0] == torch.tensor(largest[2]).item(), (history, largest)
        assert sorted(history[1:])[-2:] == sorted(torch.tensor(largest[:2]).tolist()), (history, largest)
        assert a["grad_scale"] != 1.0 and max(a["grad_amax_history"]) > 0
        print(json.dumps({"ranks_agree": True, "input_amax_history": history}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    tmp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2, join=True)
