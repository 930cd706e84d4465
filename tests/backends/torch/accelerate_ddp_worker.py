"""Run by test_huggingface.py: mixedpolicy.huggingface.Accelerator on two gloo ranks (CPU).

    python accelerate_ddp_worker.py PORT

Accelerate wraps the policy's model in DDP; each rank trains on its own batches under
mixed_float16, rank 1's loss is infinite at one step: both ranks skip it (DDP's all-reduce
carries the inf), keep the same scale and stay equal replicas. Rank 0 prints one JSON line.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

POISON = 2


def run(rank, world, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import mixedpolicy as mp
    from mixedpolicy.huggingface import Accelerator

    accelerator = Accelerator(cpu=True, policy="mixed_float16", overrides={"2": "float32"})
    assert accelerator.num_processes == world, accelerator.distributed_type
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    assert {r.path: r.compute_dtype for r in mp.describe(model)}["2"] == "float32"  # the bare model's paths
    torch.manual_seed(rank + 1)
    skipped = []
    for step in range(5):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        accelerator.backward(loss * float("inf") if (step == POISON and rank == 1) else loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
    assert skipped == [s == POISON for s in range(5)], (rank, skipped)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(both, flat)
    assert torch.equal(both[0], both[1]) and torch.isfinite(flat).all()
    accelerator.wait_for_everyone()  # both ranks passed every check before rank 0 reports
    if rank == 0:
        print(json.dumps({"skipped": skipped, "scale": accelerator.scaler.get_scale(),
                          "distributed_type": str(accelerator.distributed_type)}), flush=True)
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    tmp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2, join=True)
