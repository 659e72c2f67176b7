"""The README's examples run as written: the first ```python block (the
quick example) and each block of "Frameworks without glue", found by its
first line ("# README example: ...")."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
pytestmark = pytest.mark.skipif(not os.path.exists(README), reason="README.md not beside tests/")


def _blocks():
    return re.findall(r"```python\n(.*?)```", open(README, encoding="utf-8").read(), flags=re.S)


def _run(block, name):
    scope = {"__name__": "readme_example"}
    exec(compile(block, f"README.md: {name}", "exec"), scope)
    return scope


def _example(title):
    found = [b for b in _blocks() if b.startswith(f"# README example: {title}\n")]
    assert len(found) == 1, f"README.md has no (or several) '# README example: {title}' blocks"
    return _run(found[0], title)


def test_readme_example_runs():
    pytest.importorskip("torch")
    blocks = _blocks()
    assert blocks, "README.md has no python example"
    scope = _run(blocks[0], "example")
    assert scope["q"].grad is not None and scope["o1"].shape == (2, 1, 4, 128)
    assert float(scope["o1"][1].abs().max()) == 0.0   # the padded sequence


def test_readme_torch_compile_example():
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    s = _example("torch.compile")
    assert s["q"].grad is not None and torch.isfinite(s["q"].grad).all()
    assert s["dq"].shape == s["q"].shape and torch.isfinite(s["dq"]).all()


def test_readme_jax_example():
    pytest.importorskip("jax")
    import numpy as np
    s = _example("JAX")
    assert [tuple(x.shape) for x in s["grads"]] == [s["q"].shape, s["k"].shape, s["v"].shape]
    assert s["o_many"].shape == (2,) + tuple(s["v"].shape)
    assert s["o1"].shape == (2, 1, 4, 64) and float(np.abs(np.asarray(s["pool"])).max()) > 0


def test_readme_fla_example():
    try:
        from fla.backends import BaseBackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"fla-core >= 0.6.0 is not installed ({e})")
    s = _example("FLA")
    assert s["o"].shape == (1, 200, 4, 64) and s["ht"].shape == (2, 4, 64, 64)


def test_readme_transformers_example():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3-Next")
    import flashqla.integrations.transformers as fq_tf
    try:
        s = _example("transformers")
    finally:
        fq_tf.revert_qwen3_next()
    assert s["tokens"].shape == (1, 16)
