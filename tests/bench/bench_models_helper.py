"""Builds every bench model on one framework and records what it computes (run by test_bench).

    python bench_models_helper.py FRAMEWORK WEIGHTS_DIR OUT.npz

For each model: float32 logits of ours and of the hand-written version on test
inputs, the loss of one training step and the logits after it; then, under each
mixed or pure policy (see HALF), the logits of both versions and the loss of one step.
"""

import sys

import numpy as np

from mixedpolicy.bench import models, runners, worker
from mixedpolicy.bench.spec import RunSpec

BATCH = 8
#: Each mixed and pure policy is checked on one or two of the four models (float32 on all):
#: every build costs compilation time, and ours-against-hand-written is the same code path
#: per policy. Pure bfloat16 on the transformer, whose layer norms stay float32 on both sides
#: (but PyTorch's and Keras's own, which make them bfloat16 too); mixed_bfloat16 on the resnet
#: too, for its batch norms.
HALF = {"mlp": ("mixed_float16", "float16"), "cnn": ("mixed_bfloat16",), "transformer": ("bfloat16",),
        "resnet": ("mixed_bfloat16",), "resnet50": (), "gpt2": ()}  # the GPU-scale two: float32 only
#: Small sizes of the same architectures (on the CPU's data sizes): the check is about
#: equal math, and fast.
_SMALLER = {"mlp": {"sizes": (64, 32, 10)}, "cnn": {"channels": (4, 8)},
            "transformer": {"d_model": 16, "heads": 2, "blocks": 1, "mlp": 32},
            "resnet": {"widths": (4, 8, 8), "blocks_per_stage": 1},
            "resnet50": {"widths": (4, 4, 8, 8)},
            "gpt2": {"d_model": 16, "heads": 2, "blocks": 1, "mlp": 32}}
TINY = {model: {**models.config(model, "cpu"), **_SMALLER[model]} for model in models.MODELS}


def main(framework: str, weights_dir: str, out: str) -> None:
    runner = runners.load(framework)
    record = {}
    for model in models.MODELS:
        for policy in ("float32",) + HALF[model]:
            spec = RunSpec(framework, policy, model, BATCH, 1, 1, 0, "cpu", f"{weights_dir}/{model}.npz", 0)
            x_train, y_train, x_test, _ = worker.data(spec, runner, TINY[model])
            weights = models.load_weights(spec.weights)
            ours, native = runner.trainers(model, TINY[model], policy, weights, "cpu")
            key = f"{model}/{policy}"
            record[f"{key}/ours"] = ours.predict(x_test[:BATCH])
            record[f"{key}/native"] = native.predict(x_test[:BATCH])
            ours.step(x_train[:BATCH], y_train[:BATCH])
            record[f"{key}/loss"] = np.float32(ours.last_loss())
            record[f"{key}/after"] = ours.predict(x_test[:BATCH])
            record[f"{key}/skipped"] = np.int32(ours.skipped_steps())
    np.savez(out, **record)


if __name__ == "__main__":
    main(*sys.argv[1:])
