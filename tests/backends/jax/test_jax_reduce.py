"""mp.jax.all_reduce: gradients reduced over four host devices in the reduce dtype (reduce_worker.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_module


@pytest.mark.slow
def test_every_reduce_dtype_over_four_host_devices():
    """float32 is plain psum / pmean (within 2 ulp: different compiled programs), the half and 8-bit codecs close to the mean,
    per-layer dtypes by path, integers untouched, bytes 4 : 2 : 1 (+ scales), and an overflow
    on one replica makes every replica skip, and the digits MLP trained on four replicas with
    8-bit gradients ends within 1 point of float32's accuracy, and under jax.jit with
    NamedSharding-sharded parameters (GSPMD) the policy's casts and the optimizer keep every
    sharding, and delayed fp8 histories take the largest amax over the replicas with
    axis_name, each replica's own without (asserts in reduce_worker.py)."""
    require_module("jax")
    require_module("optax", "jax")
    worker = Path(__file__).with_name("reduce_worker.py")
    done = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True,
                          timeout=300, cwd=worker.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    n = figures["float32"] // 4  # floating elements per replica
    assert (figures["bfloat16"], figures["float16"]) == (2 * n, 2 * n)
    assert figures["float8_e5m2"] == figures["float8_e4m3fn"] == n + 2 * 4  # two tensors, two scales
    assert n < figures["per_layer"] < figures["float32"]
    # table-N: N bits a value packed into bytes, plus a float32 table per tensor (128 + 8 values)
    assert figures["table-1"] == (128 + 7) // 8 + 1 + 2 * 4 * 1
    assert figures["table-8"] == 128 + 8 + 2 * 4 * 128


def test_all_reduce_refuses_a_policy_it_cannot_read():
    jax = require_module("jax")
    import mixedpolicy as mp

    with pytest.raises(TypeError, match="Received policy=3"):
        mp.jax.bytes_per_step({"w": jax.numpy.ones(3)}, 3)
    assert mp.jax.bytes_per_step({"w": jax.numpy.ones(3), "i": jax.numpy.arange(2)}, "bfloat16") == 6


def test_an_axis_name_no_mapped_step_binds_and_a_leaf_that_is_no_array_are_refused_with_the_fix():
    jax = require_module("jax")
    import mixedpolicy as mp

    grads = {"w": jax.numpy.ones(3)}
    with pytest.raises(ValueError, match=r"axis_name='batch', which no enclosing shard_map or pmap binds"):
        mp.jax.all_reduce(grads, "batch")  # outside the mapped step
    for bad in (None, 1, "", ("batch", 2)):
        with pytest.raises(TypeError, match="expected the name .* of the shard_map / pmap axis"):
            mp.jax.all_reduce(grads, bad)
    with pytest.raises(TypeError, match=r"leaf 'b' is a float .*expected a pytree of arrays"):
        mp.jax.bytes_per_step({"w": jax.numpy.ones(3), "b": 1.5})


def test_a_class_key_names_layers_through_model_or_is_refused():
    """One layer chain for every engine: a class key sets a reduce dtype as in apply_policy
    where the gradients' model is given, and is refused (not silently ignored) where it is not."""
    jax = require_module("jax")
    nnx = require_module("flax.nnx", "jax")
    import mixedpolicy as mp

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(4, 4, rngs=rngs)
            self.norm = nnx.LayerNorm(4, rngs=rngs)

    net = Net(nnx.Rngs(0))
    grads = nnx.state(net, nnx.Param)
    f32 = mp.jax.bytes_per_step(grads, "float32")
    policy = mp.PolicyMap(mp.Policy("float32"), {nnx.Linear: mp.Policy("float32", reduce_dtype="bfloat16")})
    # Linear's kernel (16) and bias (4) travel in bfloat16: 20 values, 2 bytes fewer each
    assert mp.jax.bytes_per_step(grads, policy, model=net) == f32 - 20 * 2
    with pytest.raises(ValueError, match=r"layer-class keys \[.*Linear'?\].*by path or glob.*pass model="):
        mp.jax.bytes_per_step(grads, policy)
    by_path = mp.PolicyMap(mp.Policy("float32"), {"body": mp.Policy("float32", reduce_dtype="bfloat16")})
    assert mp.jax.bytes_per_step(grads, by_path) == f32 - 20 * 2  # the same by path, no model needed
    same = mp.PolicyMap(mp.Policy("float32"), {nnx.Linear: mp.Policy("mixed_bfloat16")})
    assert mp.jax.bytes_per_step(grads, same) == f32  # a class key that decides no reduce dtype passes
    assert jax is not None
