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

from mixedpolicy.adaprec import AdaPrec, parse_bandwidth

REDUCE_DEFAULT = ("float32", "bfloat16", "float8_e5m2")
#: beside the reduce dtypes, --reduce takes the study's two per-layer choices
SCHEMES = ("fastest", "adaprec")
#: what the adaprec run chooses among at each decision
ADAPREC_CANDIDATES = ("float32", "float8_e5m2", "table-1")


def reduce_policy(base: Any, choice: str) -> Any:
    """What `mixedpolicy.jax.all_reduce` takes for a --reduce choice under `base`: the
    policy with that reduce dtype, or, for "fastest", the study's per-layer map (weights
    in table-1, biases in float32)."""
    import mixedpolicy as mp

    if choice == "fastest":
        return mp.PolicyMap(base, {"*.kernel": mp.Policy(base, reduce_dtype="table-1"),
                                   "*.bias": mp.Policy(base, reduce_dtype="float32")})
    return mp.Policy(base, reduce_dtype=choice)


def resolve_reduce(text: str) -> tuple:
    """The reduce dtypes of ``--reduce``, in their plain names.

    Raises:
      ValueError: one of them is not a dtype gradients can be reduced in.
    """
    from mixedpolicy._dtypes import canonical_reduce_dtype

    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"Received --reduce {text!r}; expected comma-separated reduce dtypes, "
                         f"such as float32,bfloat16,float8_e5m2,table-1, or {' and '.join(SCHEMES)}.")
    return tuple(dict.fromkeys(n.lower() if n.lower() in SCHEMES else canonical_reduce_dtype(n, what="--reduce")
                               for n in names))


def run_all(args: Any, policies: tuple, reduce_dtypes: tuple, data_path: str, weights_path: str) -> list:
    """Every (policy, reduce dtype) run, one process each; prints progress."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.replicas}",
               JAX_PLATFORMS="cpu")
    runs = []
    specs = [dict(policy=p, reduce_dtype=r, replicas=args.replicas, batch_size=args.batch_size,
                  steps=args.steps, seed=args.seed, data=data_path, weights=weights_path,
                  warmup=args.warmup, bandwidth=args.bandwidth) for p in policies for r in reduce_dtypes]
    for i, spec in enumerate(specs, 1):
        print(f"  [{i}/{len(specs)}] {spec['policy']} reduce {spec['reduce_dtype']} ...", end="", flush=True)
        proc = subprocess.run([sys.executable, "-m", "mixedpolicy.bench.replicas", json.dumps(spec)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"The run under {spec['policy']} with reduce dtype "
                               f"{spec['reduce_dtype']} failed:\n{proc.stderr[-3000:]}")
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(record)
        chosen = f", chose {_choices(record)}" if "decisions" in record else ""
        print(f" accuracy {record['accuracy']:.3f}, {record['bytes_per_step']} bytes/step, "
              f"{record['step_time_ms']:.2f} ms/step{chosen}", flush=True)
    return runs


def _choices(record: dict) -> str:
    return " ".join(f"{step}:{choice}" for step, choice in record["decisions"])


def table(runs: list) -> str:
    """The Markdown table of the runs: bytes over the run (speculation included) also as a
    ratio to float32's, and the communication seconds they take at --bandwidth."""
    base = {r["policy"]: r["bytes_total"] for r in runs if r["reduce_dtype"] == "float32"}
    lines = ["| policy | reduce | replicas | accuracy | final loss | skipped | bytes/step | bytes vs float32 "
             "| comm s at bandwidth | ms/step | choices |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ratio = f"{r['bytes_total'] / base[r['policy']]:.3f}" if r["policy"] in base else "-"
        lines.append(f"| {r['policy']} | {r['reduce_dtype']} | {r['replicas']} | {r['accuracy']:.3f} | "
                     f"{r['final_loss']:.4f} | {r['skipped_steps']} | {r['bytes_per_step']} | {ratio} | "
                     f"{r['comm_seconds']:.3g} | {r['step_time_ms']:.2f} | "
                     f"{_choices(r) if 'decisions' in r else ''} |")
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
    base = mp.Policy(spec["policy"])
    opt = mp.LossScaleOptimizer(optax.sgd(LR, momentum=MOMENTUM), policy=base)

    def forward(p, x):
        p, h = base.cast_to_compute(p), base.cast_to_compute(x)
        for i, name in enumerate(layers):
            h = h @ p[name]["kernel"] + p[name]["bias"]
            if i < len(layers) - 1:
                h = jax.nn.relu(h)
        return h.astype(jnp.float32)

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y).mean()

    compiled: dict = {}

    def step_for(choice: str) -> Any:
        if choice not in compiled:
            reduce = reduce_policy(base, choice)

            def local_step(p, s, x, y):
                def scaled(q):
                    loss = loss_fn(q, x, y)
                    return opt.scale_loss(loss, s), loss

                (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(p)
                updates, s = opt.update(mp.jax.all_reduce(grads, "r", reduce), s, p)
                return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, "r")

            compiled[choice] = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("r"), P("r")),
                                                     out_specs=(P(), P(), P())))
        return compiled[choice]

    def train_step(state: tuple, idx: Any, choice: str) -> tuple:
        p, s, loss = step_for(choice)(*state, x_train[idx], y_train[idx])
        jax.block_until_ready(p)  # one step in flight: XLA:CPU collectives on few cores
        return (p, s), loss

    def bytes_of(choice: str) -> int:
        return mp.jax.bytes_per_step(params, reduce_policy(base, choice))

    state = (params, opt.init(params))
    global_batch = spec["batch_size"] * n
    order = data.batch_order(len(x_train), global_batch, spec["warmup"] + spec["steps"], spec["seed"])
    bandwidth = parse_bandwidth(spec["bandwidth"])
    times, sent, loss, ada = [], 0, None, None
    if spec["reduce_dtype"] == "adaprec":
        interval = max(spec["steps"] // 8, 2)
        ada = AdaPrec(ADAPREC_CANDIDATES, speculative_steps=max(1, min(5, interval // 2)), interval=interval,
                      bytes_per_step=bytes_of, bandwidth=bandwidth)
        t0 = time.perf_counter()
        for i, state, loss, choice in ada.run(state, order, train_step):
            if i >= spec["warmup"]:  # a step's time includes the speculation before it
                times.append(time.perf_counter() - t0)
                sent += bytes_of(choice)
            t0 = time.perf_counter()
        # speculation exchanges gradients too: every candidate's steps count
        sent += sum(len(curve) * bytes_of(c) for d in ada.decisions for c, curve in d.losses.items())
    else:
        for i, idx in enumerate(order):
            t0 = time.perf_counter()
            state, loss = train_step(state, idx, spec["reduce_dtype"])
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
                sent += bytes_of(spec["reduce_dtype"])
    params, opt_state = state
    accuracy = float((np.asarray(forward(params, x_test)).argmax(1) == y_test).mean())
    record = dict(spec, accuracy=accuracy, final_loss=float(loss), bytes_per_step=sent // max(len(times), 1),
                  bytes_total=sent, comm_seconds=sent / bandwidth,
                  step_time_ms=float(np.median(times)) * 1e3 if times else float("nan"),
                  skipped_steps=int(np.asarray(opt_state.num_skipped_steps)))
    if ada is not None:
        record["decisions"] = [(d.step, d.choice) for d in ada.decisions]
        record["rollbacks"] = list(ada.rollbacks)
    return record


if __name__ == "__main__":
    print(json.dumps(_run(json.loads(sys.argv[1]))), flush=True)
