"""The global policy is shared by all threads; policy_scope belongs to one context."""

import asyncio
import threading

import pytest

import mixedpolicy as mp


def test_default_is_float32_and_none_restores_it():
    assert mp.global_policy() == mp.Policy("float32")
    mp.set_global_policy("mixed_float16")
    assert mp.global_policy() == mp.Policy("mixed_float16")
    mp.set_global_policy(None)
    assert mp.global_policy() == mp.Policy("float32")


def test_accepts_every_policy_form():
    mp.set_global_policy("bf16-mixed")
    assert mp.global_policy().name == "mixed_bfloat16"
    mp.set_global_policy(mp.Policy("p=f32,c=f16,o=f32"))
    assert mp.global_policy().output_dtype == "float32"
    mp.set_global_policy({"name": "float16"})
    assert mp.global_policy() == mp.Policy("float16")


def test_bad_policy_leaves_the_global_unchanged():
    mp.set_global_policy("mixed_bfloat16")
    with pytest.raises(ValueError, match="'banana'"):
        mp.set_global_policy("banana")
    with pytest.raises(TypeError):
        mp.set_global_policy(42)
    assert mp.global_policy() == mp.Policy("mixed_bfloat16")


def test_global_is_visible_to_other_threads():
    mp.set_global_policy("mixed_float16")
    seen = []
    t = threading.Thread(target=lambda: seen.append(mp.global_policy()))
    t.start()
    t.join()
    assert seen == [mp.Policy("mixed_float16")]


def test_set_in_a_thread_is_visible_to_the_main_thread():
    t = threading.Thread(target=mp.set_global_policy, args=("mixed_bfloat16",))
    t.start()
    t.join()
    assert mp.global_policy() == mp.Policy("mixed_bfloat16")


def test_scope_nests_restores_and_survives_exceptions():
    mp.set_global_policy("mixed_float16")
    with mp.policy_scope("float32") as outer:
        assert outer == mp.Policy("float32") == mp.global_policy()
        with mp.policy_scope("bfloat16"):
            assert mp.global_policy() == mp.Policy("bfloat16")
        assert mp.global_policy() == mp.Policy("float32")
        with pytest.raises(RuntimeError):
            with mp.policy_scope("float16"):
                raise RuntimeError
        assert mp.global_policy() == mp.Policy("float32")
    assert mp.global_policy() == mp.Policy("mixed_float16")


def test_scope_is_per_thread():
    barrier = threading.Barrier(2)
    seen = {}

    def worker(name, policy):
        with mp.policy_scope(policy):
            barrier.wait()  # both scopes are open at once
            seen[name] = mp.global_policy()
            barrier.wait()

    threads = [threading.Thread(target=worker, args=("a", "float16")),
               threading.Thread(target=worker, args=("b", "bfloat16"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": mp.Policy("float16"), "b": mp.Policy("bfloat16")}
    assert mp.global_policy() == mp.Policy("float32")


def test_scope_is_per_asyncio_task():
    async def task(policy, gate):
        with mp.policy_scope(policy):
            await gate.wait()
            return mp.global_policy()

    async def main():
        gate = asyncio.Event()
        tasks = [asyncio.create_task(task(p, gate)) for p in ("float16", "bfloat16")]
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == [mp.Policy("float16"), mp.Policy("bfloat16")]


def test_scope_rejects_bad_input_before_entering():
    with pytest.raises(ValueError):
        with mp.policy_scope("mixed_int4"):
            pass  # pragma: no cover
    assert mp.global_policy() == mp.Policy("float32")
