"""`import mixedpolicy` and every core call import no framework (run in a fresh process)."""

import subprocess
import sys
import textwrap

FRAMEWORKS = ("torch", "jax", "jaxlib", "tensorflow", "keras", "optax", "flax", "jmp")


def test_core_imports_no_framework():
    code = textwrap.dedent(f"""
        import sys, warnings
        import numpy as np
        import mixedpolicy as mp
        p = mp.Policy("mixed_float16"); mp.Policy("p=f32,c=bf16,o=f32"); mp.Policy("bf16-mixed")
        p.get_config(); mp.Policy.from_config(p.get_config()); hash(p)
        mp.set_global_policy("mixed_bfloat16"); mp.global_policy()
        with mp.policy_scope("float32"): pass
        m = mp.PolicyMap("mixed_float16", {{"a.*": "float32", "b": "float16"}})
        m.resolve([mp.LayerInfo("", object), mp.LayerInfo("a.x", object, "normalization")])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.warn_unmatched([mp.LayerInfo("c", object)])
        for s in (mp.DynamicLossScale(), mp.StaticLossScale(8.0), mp.NoLossScale()):
            s = s.adjust(False).adjust(True)
            s.unscale(s.scale(np.float32(1.0)))
        f = mp.apply_policy(lambda w, x: w * x, "mixed_float16")
        f(np.float32(1.0), np.ones(3, np.float32)); mp.describe(f)
        p.cast_to_compute({{"w": np.ones(2, np.float32)}})
        for bad in (object(), 3):
            try:
                mp.LossScaleOptimizer(bad)
            except TypeError:
                pass
        print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
