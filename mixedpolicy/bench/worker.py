"""One (framework, policy) run of `mixedpolicy bench`, in a process of its own.

    python -m mixedpolicy.bench.worker '<RunSpec as JSON>'

prints one JSON line: the run's record. Two trainers are built from the same
initial weights: ours (mixedpolicy) and native (the framework's own tools, written
by hand), and for the timing a third, ours under float32. They take the same batches in
the same order: `warmup` untimed steps (compilation), `steps` steps for the quality
figures, then interleaved timed blocks, the device synchronised before each timer read
(see `run`). A user's factory may bring its own batches (see `user_model`).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import statistics
import sys
import time
import numpy as np

from mixedpolicy.bench import models, runners, user_model
from mixedpolicy.bench.ratios import median_ci
from mixedpolicy.bench.data import batch_order, digits, load, synthetic
from mixedpolicy.bench.spec import RunSpec
from mixedpolicy.bench.trainer import Trainer, pin_tf32


#: A synthetic training set holds this many batches (the batch order cycles through them).
SYNTHETIC_BATCHES = 4


def data(spec: RunSpec, runner, cfg: dict | None = None) -> tuple:
    """x_train, y_train, x_test, y_test in the model's input shape, laid out for the framework:
    the training labels are what the loss takes (gpt2: the next tokens), the test labels
    what the accuracy compares with (digits' classes). `cfg`: the model's sizes, if not the
    device's (a smaller model's input size)."""
    cfg = cfg or models.config(spec.model, spec.device, spec.dataset)
    prepare = getattr(runner, "prepare", lambda model, x: x)
    if spec.dataset == "synthetic":
        x_train, y_train, x_test, y_test = synthetic(spec.model, cfg, SYNTHETIC_BATCHES * spec.batch_size,
                                                     spec.batch_size, spec.seed)
        return prepare(spec.model, x_train), y_train, prepare(spec.model, x_test), y_test
    x_train, y_train, x_test, y_test = load(spec.data) if spec.data else digits(spec.seed)
    x_train, x_test = models.inputs(spec.model, x_train, cfg), models.inputs(spec.model, x_test, cfg)
    return (prepare(spec.model, x_train), models.targets(spec.model, x_train, y_train),
            prepare(spec.model, x_test), y_test)


def build(spec: RunSpec, runner, policy: str | None = None) -> tuple:
    """(ours, native): the two trainers of the run (under `policy`, else the run's), from the
    shared initial weights. The "tf32" baseline is the float32 policy with TF32 math allowed."""
    cfg = models.config(spec.model, spec.device, spec.dataset)
    policy = policy or spec.policy
    return runner.trainers(spec.model, cfg, "float32" if policy == "tf32" else policy,
                           models.load_weights(spec.weights), spec.device, compile=spec.compile,
                           tf32=policy == "tf32")


def evaluate(spec: RunSpec, trainer: Trainer, x: np.ndarray, y: np.ndarray) -> tuple:
    """(test accuracy, test loss) of `trainer`'s current weights, read from the same logits (in
    batches, so a large model's logits fit the device); the loss is the mean cross entropy of
    the class logits in float64, the held-out figure a last training batch's loss is too noisy
    to be. (None, None) on synthetic data, whose labels are noise."""
    if spec.dataset == "synthetic":
        return None, None
    hits, nll = 0, 0.0
    for i in range(0, len(x), spec.batch_size):
        logits = models.class_logits(spec.model, trainer.predict(x[i:i + spec.batch_size])).astype(np.float64)
        target = y[i:i + spec.batch_size]
        hits += int(np.sum(np.argmax(logits, -1) == target))
        top = logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        nll += float(np.sum(log_z - np.take_along_axis(logits, target[:, None], -1)[:, 0]))
    return hits / len(x), nll / len(x)


class _Feed:
    """One trainer's walk through the shared batch order (its cursor), so ours and native
    see the same batches in the same order however their blocks are cut."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, seed: int):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.order, self.cursor = batch_order(len(x), batch_size, 1, seed), 0

    def take(self, n: int) -> list:
        if self.cursor + n > len(self.order):  # the same order, longer (it extends its prefix)
            self.order = batch_order(len(self.x), self.batch_size, 2 * (self.cursor + n), self.seed)
        rows = self.order[self.cursor:self.cursor + n]
        self.cursor += n
        return [(self.x[i], self.y[i]) for i in rows]


class _Cycle:
    """One trainer's walk through a user's own batches, in order, from the first again at the end."""

    def __init__(self, batches: list):
        self.batches, self.cursor = batches, 0

    def take(self, n: int) -> list:
        rows = [self.batches[(self.cursor + i) % len(self.batches)] for i in range(n)]
        self.cursor += n
        return rows


def _numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def batch_accuracy(trainer: Trainer, batches: list) -> float | None:
    """The share of a user's own targets that the logits' argmax hits, over its batches; None
    where the targets are not class indices of the logits' leading shape (a loss of its own)."""
    hits = total = 0
    for x, y in batches:
        logits, y = trainer.predict(x), _numpy(y)
        if not np.issubdtype(y.dtype, np.integer) or logits.shape[:-1] != y.shape:
            return None
        hits += int(np.sum(np.argmax(logits, -1) == y))
        total += y.size
    return hits / max(total, 1)


def _timed(trainer: Trainer, batches: list) -> float:
    """Seconds for `trainer` to take these steps, the device synchronised before each read."""
    trainer.sync()
    start = time.perf_counter()
    trainer.steps(batches)
    trainer.sync()
    return time.perf_counter() - start


def block_steps(measure, min_block_s: float, limit: int = 1 << 20) -> int:
    """About the fewest steps per block that make a block last `min_block_s`: `measure(n)`
    times n steps (both trainers; it returns the faster), and n grows to the estimate
    (with 5% to spare) until a block is long enough."""
    n = 1
    while n < limit:
        elapsed = measure(n)
        if elapsed >= min_block_s:
            break
        n = min(limit, max(n + 1, math.ceil(1.05 * n * min_block_s / max(elapsed, 1e-9))))
    return n


def run(spec: RunSpec) -> dict:
    """The run's record, from two phases.

    Quality: after `warmup` untimed steps each (compilation), ours and native each
    train `steps` steps on the shared batch order; the loss curve, final loss, accuracy,
    skipped steps and loss scale come from here, the same schedule on every framework.

    Timing: then `repeats` triples of blocks, interleaved (ours, native, reference, then
    reference, native, ours, ...; the reference is ours under float32, from the same
    weights) so that drifts of the machine hit every side alike; a block has as many steps
    as make it last `min_block_s` (`timed_steps_per_block`), so timer and scheduler noise
    stay small against it. The overhead is the median of the (ours / native) ratios, the
    speed-up over float32 that of the (reference / ours) ratios, each with its median's
    95% interval (`ratios.median_ci`).
    """
    runner = runners.load(spec.framework)
    ours, native = build(spec, runner)
    reference = None  # ours under float32, built for the timing phase
    own = ours.user_batches  # a user's factory brought its own batches: cycled through, in order
    if own is None:
        x_train, y_train, x_test, y_test = data(spec, runner)
        feeds = {t: _Feed(x_train, y_train, spec.batch_size, spec.seed) for t in (ours, native)}
        batch_size = spec.batch_size
    else:
        feeds = {t: _Cycle(own) for t in (ours, native)}
        batch_size = user_model.batch_size(own[0][0])

    def score(trainer: Trainer) -> tuple:
        return evaluate(spec, trainer, x_test, y_test) if own is None else (batch_accuracy(trainer, own), None)

    def advance(trainer: Trainer, n: int) -> float:
        if spec.policy == "tf32":  # TF32 is a global switch: on for ours and native, off for the reference
            pin_tf32(runners.runner(spec.framework).backend, spec.device, trainer is not reference)
        return _timed(trainer, feeds[trainer].take(n)) / n if n else 0.0

    for trainer in (ours, native):
        advance(trainer, spec.warmup)
    losses, every = [], max(1, spec.steps // 50)
    for done in range(0, spec.steps, every):
        n = min(every, spec.steps - done)
        advance(ours, n)
        advance(native, n)
        losses.append([spec.warmup + done + n, ours.last_loss(), native.last_loss()])  # step, ours, native
    (accuracy_ours, test_loss), (accuracy_native, native_test_loss) = score(ours), score(native)
    quality = {
        "final_loss": losses[-1][1],
        "loss_curve": losses,
        "accuracy": accuracy_ours,
        "native_accuracy": accuracy_native,
        "test_loss": test_loss,
        "native_test_loss": native_test_loss,
        "skipped_steps": ours.skipped_steps(),
        "final_loss_scale": ours.loss_scale(),
    }

    # the speed-up over float32: ours under float32 (an A/A twin under float32 itself), from the
    # same weights, timed in the same blocks; it trains only here, so quality is unaffected
    reference = build(spec, runner, "float32")[0]
    pin_tf32(runners.runner(spec.framework).backend, spec.device, spec.policy == "tf32")
    feeds[reference] = _Cycle(own) if own is not None else _Feed(x_train, y_train, spec.batch_size, spec.seed)
    advance(reference, max(spec.warmup, 1))
    source = None  # an fp8 row: ours under its source policy too (the fp8 speed-up over bf16...)
    if spec.policy != "tf32" and mp_policy(spec.policy).float8_recipe is not None:
        source = build(spec, runner, mp_policy(spec.policy).source.name)[0]
        feeds[source] = _Cycle(own) if own is not None else _Feed(x_train, y_train, spec.batch_size, spec.seed)
        advance(source, max(spec.warmup, 1))
    n = block_steps(lambda n: min(advance(ours, n), advance(native, n)) * n, spec.min_block_s)
    sides = (ours, native, reference) + ((source,) if source is not None else ())
    times: dict = {trainer: [] for trainer in sides}
    for r in range(spec.repeats):  # the order turns every repeat, so drifts hit each side alike
        for trainer in (sides if r % 2 == 0 else sides[::-1]):
            times[trainer].append(advance(trainer, n))
    t_ours, t_native = times[ours], times[native]
    ratios = [a / b for a, b in zip(t_ours, t_native)]
    speedups = [f / a for a, f in zip(t_ours, times[reference])]
    median = statistics.median(t_ours)
    peak = ours.peak_memory_bytes()
    if peak is None:  # on the CPU: the process's peak resident memory (both trainers)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = None  # a step's tokens, where the inputs are token ids
    if own is not None:  # a user's batches (of token ids, a language model's: counted)
        tokens = user_model.tokens(own[0][0])
    elif spec.model == "gpt2":
        tokens = batch_size * models.input_shape(spec.model, models.config(spec.model, spec.device, spec.dataset))[0]
    return {
        "framework": spec.framework, "policy": spec.policy, "model": spec.model,
        "data": spec.dataset if own is None else "own batches", "compile": spec.compile,
        "batch_size": batch_size, "own_data": own is not None, "steps": spec.steps, "repeats": spec.repeats,
        "timed_steps_per_block": n,
        "step_time_s": {"median": median, "min": min(t_ours), "max": max(t_ours)},
        "native_step_time_s": {"median": statistics.median(t_native), "min": min(t_native),
                               "max": max(t_native)},
        "throughput_samples_per_s": batch_size / median,
        **({"throughput_tokens_per_s": tokens / median} if tokens else {}),
        "peak_memory_bytes": int(peak),
        **quality,
        "native_recipe": native.recipe,
        "overhead_vs_native": statistics.median(ratios),
        "overhead_ratios": ratios,
        "overhead_ci": median_ci(ratios),
        # ours under float32 over ours under the policy, block by block in this process
        "speedup_vs_float32": statistics.median(speedups),
        "speedup_ratios": speedups,
        "speedup_ci": median_ci(speedups),
        **({} if source is None else _over_source(times[source], t_ours, mp_policy(spec.policy).source.name)),
        "memory": {"ours": ours.memory(), "native": native.memory()},
        "threads": _threads_in_force(),
    }


def mp_policy(name: str):
    import mixedpolicy as mp

    return mp.Policy(name)


def _over_source(t_source: list, t_ours: list, name: str) -> dict:
    """An fp8 row's speed-up over its source policy, block by block in this process."""
    ratios = [s / a for a, s in zip(t_ours, t_source)]
    return {"source_policy": name, "speedup_vs_source": statistics.median(ratios),
            "speedup_vs_source_ratios": ratios, "speedup_vs_source_ci": median_ci(ratios)}


def _threads_in_force() -> dict:
    """The intra-op thread counts the worker's frameworks report (read, not assumed)."""
    found: dict = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = torch.get_num_threads()
        found["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # torch's own report
        found["torch_blas"] = ",".join(re.findall(r"BLAS_INFO=(\w+)", torch.__config__.show()))
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        found["tensorflow"] = tf.config.threading.get_intra_op_parallelism_threads() or os.environ.get(
            "TF_NUM_INTRAOP_THREADS")
    if "jax" in sys.modules:
        found["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    if hasattr(os, "sched_getaffinity"):  # the cores this worker may run on (runners.cores)
        found["cores"] = sorted(os.sched_getaffinity(0))
    return found


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec = RunSpec(**json.loads(argv[0]))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    print(json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    main()
