"""The README's example runs as written (its first ```python block)."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@pytest.mark.skipif(not os.path.exists(README), reason="README.md not beside tests/")
def test_readme_example_runs():
    pytest.importorskip("torch")
    text = open(README, encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python example"
    scope = {}
    exec(compile(blocks[0], "README.md example", "exec"), scope)
    assert scope["q"].grad is not None and scope["o1"].shape == (2, 1, 4, 128)
    assert float(scope["o1"][1].abs().max()) == 0.0   # the padded sequence
