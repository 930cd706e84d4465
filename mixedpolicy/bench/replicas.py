"""`mixedpolicy bench --replicas N`: the digits MLP trained data-parallel on N JAX replicas
(host devices on a CPU) under each policy and each reduce dtype, side by side.

Each (policy, reduce dtype) runs in a process of its own, started with N host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``): the same initial weights and
batch order, gradients reduced by `mixedpolicy.jax.all_reduce`, SGD with momentum. A row
reports the test accuracy, the final training loss, the bytes one replica sends per step
(counted from the tensors exchanged) and the median step time. On a CPU the replicas share
its cores: the times show the codecs' cost, not a network's.

    python -m mixedpolicy.bench.replicas SPEC_JSON      # one run (what the command starts)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

REDUCE_DEFAULT = ("float32", "bfloat16", "float8_e5m2")


def resolve_reduce(text: str) -> tuple:
    """The reduce dtypes of ``--reduce``, in their plain names.

    Raises:
      ValueError: one of them is not a dtype gradients can be reduced in.
    """
    from mixedpolicy._dtypes import canonical_reduce_dtype

    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"Received --reduce {text!r}; expected comma-separated reduce dtypes, "
                         f"such as float32,bfloat16,float8_e5m2.")
    return tuple(dict.fromkeys(canonical_reduce_dtype(n, what="--reduce") for n in names))


def run_all(args: Any, policies: tuple, reduce_dtypes: tuple, data_path: str, weights_path: str) -> list:
    """Every (policy, reduce dtype) run, one process each; prints progress."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.replicas}",
               JAX_PLATFORMS="cpu")
    runs = []
    specs = [dict(policy=p, reduce_dtype=r, replicas=args.replicas, batch_size=args.batch_size,
                  steps=args.steps, seed=args.seed, data=data_path, weights=weights_path,
                  warmup=args.warmup) for p in policies for r in reduce_dtypes]
    for i, spec in enumerate(specs, 1):
        print(f"  [{i}/{len(specs)}] {spec['policy']} reduce {spec['reduce_dtype']} ...", end="", flush=True)
        proc = subprocess.run([sys.executable, "-m", "mixedpolicy.bench.replicas", json.dumps(spec)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"The run under {spec['policy']} with reduce dtype "
                               f"{spec['reduce_dtype']} failed:\n{proc.stderr[-3000:]}")
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(record)
        print(f" accuracy {record['accuracy']:.3f}, {record['bytes_per_step']} bytes/step, "
              f"{record['step_time_ms']:.2f} ms/step", flush=True)
    return runs


def table(runs: list) -> str:
    """The Markdown table of the runs, bytes also as a ratio to float32's."""
    base = {r["policy"]: r["bytes_per_step"] for r in runs if r["reduce_dtype"] == "float32"}
    lines = ["| policy | reduce dtype | replicas | accuracy | final loss | skipped | bytes/step | vs float32 | ms/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ratio = f"{r['bytes_per_step'] / base[r['policy']]:.3f}" if r["policy"] in base else "-"
        lines.append(f"| {r['policy']} | {r['reduce_dtype']} | {r['replicas']} | {r['accuracy']:.3f} | "
                     f"{r['final_loss']:.4f} | {r['skipped_steps']} | {r['bytes_per_step']} | {ratio} | "
                     f"{r['step_time_ms']:.2f} |")
    return "\n".join(lines)


def _run(spec: dict) -> dict:
    """One run, in a process with `replicas` host devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, PartitionSpec as P

    import mixedpolicy as mp
    from mixedpolicy.bench import data
    from mixedpolicy.bench.models import LR, MOMENTUM

    n = spec["replicas"]
    if jax.device_count() < n:
        raise RuntimeError(f"{jax.device_count()} JAX devices for {n} replicas")
    mesh = Mesh(np.array(jax.devices()[:n]), ("r",))
    x_train, y_train, x_test, y_test = data.load(spec["data"])
    with np.load(spec["weights"]) as f:
        weights = {k: jnp.asarray(f[k]) for k in f.files}
    layers = sorted({k.rpartition(".")[0] for k in weights})
    params = {name: {"kernel": weights[f"{name}.kernel"], "bias": weights[f"{name}.bias"]} for name in layers}
    policy = mp.Policy(spec["policy"], reduce_dtype=spec["reduce_dtype"])
    tx = optax.sgd(LR, momentum=MOMENTUM)
    opt = mp.LossScaleOptimizer(tx, policy=policy)

    def forward(p, x):
        p, h = policy.cast_to_compute(p), policy.cast_to_compute(x)
        for i, name in enumerate(layers):
            h = h @ p[name]["kernel"] + p[name]["bias"]
            if i < len(layers) - 1:
                h = jax.nn.relu(h)
        return h.astype(jnp.float32)

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y).mean()

    def local_step(p, s, x, y):
        def scaled(q):
            loss = loss_fn(q, x, y)
            return opt.scale_loss(loss, s), loss

        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(p)
        grads = mp.jax.all_reduce(grads, "r", policy)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, "r")

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("r"), P("r")),
                                 out_specs=(P(), P(), P())))
    state = opt.init(params)
    global_batch = spec["batch_size"] * n
    order = data.batch_order(len(x_train), global_batch, spec["warmup"] + spec["steps"], spec["seed"])
    times, loss = [], None
    for i, idx in enumerate(order):
        t0 = time.perf_counter()
        params, state, loss = step(params, state, x_train[idx], y_train[idx])
        jax.block_until_ready(params)  # one step in flight: XLA:CPU collectives on few cores
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    accuracy = float((np.asarray(forward(params, x_test)).argmax(1) == y_test).mean())
    return dict(spec, accuracy=accuracy, final_loss=float(loss),
                bytes_per_step=mp.jax.bytes_per_step(params, policy),
                step_time_ms=float(np.median(times)) * 1e3 if times else float("nan"),
                skipped_steps=int(np.asarray(state.num_skipped_steps)))


if __name__ == "__main__":
    print(json.dumps(_run(json.loads(sys.argv[1]))), flush=True)
