"""What the optax wrapper's skip costs by state size: ``python -m mixedpolicy.bench.skip_sweep``.

A `LossScaleOptimizer` around an optax transformation checks the gradients and skips a
non-finite update inside the jitted step: by a select of each updated leaf, or by a
``jax.lax.cond`` (gradients of `COND_ELEMENTS` or more). Which is cheaper depends on whether
the caller donates the parameters and state to the step, which the wrapper cannot see. This
sweep times, for GPT-2-shaped parameters of each ``--d-model`` (12 blocks and an embedding of
64 x d_model rows: 208 d**2 + 109 d values, 123M at 768), AdamW's jitted step (update and
``optax.apply_updates``, no model) side by side, interleaved, median of ``--repeats`` rounds:

- ``bare``: ``optax.adamw`` alone;
- ``selects``: ``mp.LossScaleOptimizer(optax.adamw(...))`` under ``float32`` (the check, no
  scale), skipping by selects;
- ``cond``: the same wrapper skipping by ``jax.lax.cond``;

each with its inputs donated (``--donate on``), not (``off``) or both. It prints and writes to
``--out`` (JSON) each side's median time and its ratio to ``bare`` with the interquartile
range. The CPU table of docs/benchmarks.md ("the safety check under every policy") comes from
it; on a GPU it times JAX's default device the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from mixedpolicy.bench.outputs import check_out_file


def gpt2_shaped(d: int, seed: int = 0) -> dict:
    """Float32 parameters shaped as GPT-2's for width `d`: 12 blocks and a 64 d x d embedding."""
    import jax
    import jax.numpy as jnp

    shapes = {"wte": (64 * d, d), "ln_f": (d,)}
    for i in range(12):
        shapes.update({f"h{i}.qkv": (d, 3 * d), f"h{i}.qkv_b": (3 * d,), f"h{i}.proj": (d, d),
                       f"h{i}.fc": (d, 4 * d), f"h{i}.fc_b": (4 * d,), f"h{i}.fc2": (4 * d, d),
                       f"h{i}.ln1": (d,), f"h{i}.ln2": (d,)})
    key = jax.random.key(seed)
    return {name: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02
            for i, (name, shape) in enumerate(shapes.items())}


def _steps(donate: bool) -> dict:
    """The sides' jitted steps, each ``(params, state, grads) -> (params, state)``, and their optax
    transformations."""
    import jax
    import optax

    import mixedpolicy as mp
    from mixedpolicy.backends.jax import optax as adapter

    sides = {}
    for name, cond_elements in (("bare", None), ("selects", sys.maxsize), ("cond", 0)):
        tx = optax.adamw(1e-3)
        if cond_elements is not None:
            tx = mp.LossScaleOptimizer(tx, policy="float32")

        def step(p: Any, s: Any, g: Any, tx: Any = tx, cond_elements: Any = cond_elements) -> Any:
            default = adapter.COND_ELEMENTS
            adapter.COND_ELEMENTS = default if cond_elements is None else cond_elements  # while tracing
            try:
                updates, s = tx.update(g, s, p)
            finally:
                adapter.COND_ELEMENTS = default
            return optax.apply_updates(p, updates), s

        sides[name] = (jax.jit(step, donate_argnums=(0, 1) if donate else ()), tx)
    return sides


def measure(d: int, donate: bool, repeats: int = 7, calls: int = 10) -> dict:
    """One size, one way of donating: each side's median seconds a step and its ratio to bare."""
    import jax
    import numpy as np

    params = gpt2_shaped(d)
    grads = jax.tree_util.tree_map(lambda p: p * 0.1, params)
    sides = _steps(donate)
    with jax.numpy_dtype_promotion("standard"):
        state = {name: (jax.tree_util.tree_map(lambda x: x.copy(), params), tx.init(params))
                 for name, (_, tx) in sides.items()}

    def block(name: str, n: int) -> float:
        step = sides[name][0]
        start = time.perf_counter()
        for _ in range(n):
            state[name] = step(*state[name], grads)
        jax.block_until_ready(state[name])
        return (time.perf_counter() - start) / n

    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW mixes a Python float and an int32 count
        for name in sides:
            block(name, 2)  # compile, warm
        rounds = [{name: block(name, calls) for name in sides} for _ in range(repeats)]
    # every side made the same steps: the same parameters, within float32 rounding (three programs)
    same = all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
               for name in ("selects", "cond") for a, b in zip(jax.tree_util.tree_leaves(state[name][0]),
                                                               jax.tree_util.tree_leaves(state["bare"][0])))
    row: dict = {"d_model": d, "parameters": sum(p.size for p in jax.tree_util.tree_leaves(params)),
                 "donated": donate, "device": str(jax.devices()[0]), "same_parameters": same}
    for name in sides:
        row[f"{name}_s"] = statistics.median(r[name] for r in rounds)
        if name != "bare":
            ratios = sorted(r[name] / r["bare"] for r in rounds)
            q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
            row[f"{name}/bare"] = [statistics.median(ratios), q[0], q[2]]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mixedpolicy.bench.skip_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", default="64,153,384", help="comma-separated widths (default: 64,153,384)")
    parser.add_argument("--donate", default="on,off", choices=["on", "off", "on,off", "off,on"],
                        metavar="on|off|on,off", help="donate the step's inputs, not, or both (default: on,off)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (default: 7)")
    parser.add_argument("--calls", type=int, default=10, help="steps a timed block (default: 10)")
    parser.add_argument("--out", default=None, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    try:
        widths = [int(w) for w in args.d_model.split(",")]
    except ValueError:
        parser.error(f"--d-model {args.d_model!r}: expected whole numbers separated by commas, e.g. 64,153,384")
    if any(w < 1 for w in widths) or args.repeats < 1 or args.calls < 1:
        parser.error("--d-model, --repeats and --calls take numbers of at least 1")
    try:
        check_out_file(args.out)
    except ValueError as err:
        parser.error(str(err))
    rows = []
    for d in widths:
        for donate in [part == "on" for part in args.donate.split(",")]:
            row = measure(d, donate, args.repeats, args.calls)
            rows.append(row)
            print(f"d_model {d:5d} ({row['parameters'] / 1e6:7.2f}M) donated {'yes' if donate else 'no ':3s}  "
                  f"bare {row['bare_s'] * 1e3:8.3f} ms  "
                  + "  ".join(f"{side}/bare {row[side + '/bare'][0]:.3f} [{row[side + '/bare'][1]:.3f}, "
                              f"{row[side + '/bare'][2]:.3f}]" for side in ("selects", "cond"))
                  + ("" if row["same_parameters"] else "  (the sides' parameters differ!)"), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
