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
#: what the adaprec run chooses among at each decision, and how many decisions a run makes
ADAPREC_CANDIDATES = ("float32", "float8_e5m2", "table-1")
ADAPREC_DECISIONS = 4
#: points of each run's learning curve (loss, test accuracy, bytes and modelled time so far)
CURVE_POINTS = 40
#: the accuracy "time to target" is measured at
TARGET_ACCURACY = 0.95


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
    # the host devices added to the user's own XLA flags, not in their place
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={args.replicas}".strip(),
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


def to_target(run: dict, target: float = TARGET_ACCURACY) -> tuple | None:
    """(steps, modelled seconds) when the run's test accuracy first reached `target`, or None;
    seconds are the measured step times plus the bytes so far over --bandwidth."""
    for step, _, accuracy, _, seconds in run["curve"]:
        if accuracy >= target:
            return step, seconds
    return None


def table(runs: list) -> str:
    """The Markdown table of the runs: bytes over the run (speculation included) also as a
    ratio to float32's, the communication seconds they take at --bandwidth, and when the
    test accuracy first reached the target (steps, modelled seconds)."""
    base = {r["policy"]: r["bytes_total"] for r in runs if r["reduce_dtype"] == "float32"}
    lines = ["| policy | reduce | replicas | accuracy | final loss | skipped | bytes/step | bytes vs float32 "
             f"| comm s at bandwidth | ms/step | to {TARGET_ACCURACY:.0%} (steps, s) | choices |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ratio = f"{r['bytes_total'] / base[r['policy']]:.3f}" if r["policy"] in base else "-"
        reached = to_target(r)
        target = "-" if reached is None else f"{reached[0]}, {reached[1]:.2f}"
        lines.append(f"| {r['policy']} | {r['reduce_dtype']} | {r['replicas']} | {r['accuracy']:.3f} | "
                     f"{r['final_loss']:.4f} | {r['skipped_steps']} | {r['bytes_per_step']} | {ratio} | "
                     f"{r['comm_seconds']:.3g} | {r['step_time_ms']:.2f} | {target} | "
                     f"{_choices(r) if 'decisions' in r else ''} |")
    return "\n".join(lines)


def plot(runs: list, path: str) -> str:
    """The study's figure, in shape: test accuracy against training steps and against the
    modelled time (compute + bytes over the bandwidth), one line per run, AdaPrec's decisions
    marked with the choice they made (a rolled-back one crossed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab10")
    for i, r in enumerate(runs):
        steps, _, accuracy, _, seconds = zip(*r["curve"]) if r["curve"] else ((), (), (), (), ())
        label = f"{r['reduce_dtype']} ({r['policy']})" if len({x['policy'] for x in runs}) > 1 else r["reduce_dtype"]
        for ax, xs in zip(axes, (steps, seconds)):
            ax.plot(xs, accuracy, color=colors(i % 10), label=label, linewidth=2 if "decisions" in r else 1.2)
        rolled = {step for step, _ in r.get("rollbacks", [])}
        for step, choice in r.get("decisions", []):
            at = min(range(len(steps)), key=lambda j: abs(steps[j] - step)) if steps else None
            if at is None:
                continue
            for ax, xs in zip(axes, (steps, seconds)):
                ax.plot(xs[at], accuracy[at], marker="o", color=colors(i % 10))
                ax.annotate(choice, (xs[at], accuracy[at]), textcoords="offset points", xytext=(4, -12),
                            fontsize=7, color=colors(i % 10))
            for step_back in rolled:
                back = min(range(len(steps)), key=lambda j: abs(steps[j] - step_back))
                axes[0].plot(steps[back], accuracy[back], marker="x", color="black")
    axes[0].set_xlabel("training step")
    axes[1].set_xlabel("modelled seconds (measured compute + bytes / bandwidth)")
    for ax in axes:
        ax.set_ylabel("test accuracy")
        ax.axhline(TARGET_ACCURACY, color="grey", linestyle=":", linewidth=0.8)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{runs[0]['replicas']} replicas at {runs[0]['bandwidth']}: accuracy by reduce dtype "
                 f"(AdaPrec's decisions marked; x: rolled back)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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

    def accuracy_of(p: Any) -> float:
        return float((np.asarray(forward(p, x_test)).argmax(1) == y_test).mean())

    state = (params, opt.init(params))
    global_batch = spec["batch_size"] * n
    order = data.batch_order(len(x_train), global_batch, spec["warmup"] + spec["steps"], spec["seed"])
    bandwidth = parse_bandwidth(spec["bandwidth"])
    every = max(1, spec["steps"] // CURVE_POINTS)
    times, sent, loss, ada, curve = [], 0, None, None, []

    def record_step(i: int, state: tuple, loss: Any, choice: str, seconds: float, extra_bytes: int = 0) -> None:
        nonlocal sent
        if i < spec["warmup"]:
            return
        times.append(seconds)
        sent += bytes_of(choice) + extra_bytes
        done = i + 1 - spec["warmup"]
        if done % every == 0 or done == spec["steps"]:  # (step, loss, accuracy, bytes, modelled s)
            curve.append((done, float(loss), accuracy_of(state[0]), sent, sum(times) + sent / bandwidth))

    if spec["reduce_dtype"] == "adaprec":
        interval = max(spec["steps"] // ADAPREC_DECISIONS, 2)
        ada = AdaPrec(ADAPREC_CANDIDATES, speculative_steps=max(1, min(4, interval // 8)), interval=interval,
                      bytes_per_step=bytes_of, bandwidth=bandwidth)
        for choice in ADAPREC_CANDIDATES:  # compiled first: speculation measures steps, not compilation
            jax.block_until_ready(step_for(choice)(*state, x_train[order[0]], y_train[order[0]]))
        t0, seen = time.perf_counter(), 0
        for i, state, loss, choice in ada.run(state, order, train_step):
            # speculation exchanges gradients too: the candidates not chosen count here (the
            # chosen one's speculative steps are training steps, counted as they are yielded)
            extra = 0
            if len(ada.decisions) > seen:
                seen, d = len(ada.decisions), ada.decisions[-1]
                extra = sum(len(c) * bytes_of(k) for k, c in d.losses.items() if k != d.choice)
            record_step(i, state, loss, choice, time.perf_counter() - t0, extra)  # speculation's time too
            t0 = time.perf_counter()
    else:
        for i, idx in enumerate(order):
            t0 = time.perf_counter()
            state, loss = train_step(state, idx, spec["reduce_dtype"])
            record_step(i, state, loss, spec["reduce_dtype"], time.perf_counter() - t0)
    params, opt_state = state
    record = dict(spec, accuracy=accuracy_of(params), final_loss=float(loss),
                  bytes_per_step=sent // max(len(times), 1), bytes_total=sent, comm_seconds=sent / bandwidth,
                  step_time_ms=float(np.median(times)) * 1e3 if times else float("nan"),
                  skipped_steps=int(np.asarray(opt_state.num_skipped_steps)), curve=curve)
    if ada is not None:
        record["decisions"] = [(max(d.step - spec["warmup"], 0), d.choice) for d in ada.decisions]
        record["decision_log"] = [{"step": max(d.step - spec["warmup"], 0), "choice": d.choice,
                                   "scores": d.scores, "predicted": d.predicted, "losses": d.losses,
                                   "seconds_per_step": d.seconds_per_step} for d in ada.decisions]
        record["rollbacks"] = [(max(step - spec["warmup"], 0), c) for step, c in ada.rollbacks]
    return record


if __name__ == "__main__":
    print(json.dumps(_run(json.loads(sys.argv[1]))), flush=True)
