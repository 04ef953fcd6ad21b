"""The Python examples of docs/integrations.md, run as a reader would paste them (the Ray
example's command runs in test_integration_ray.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\n```python\n(.+?)\n```", DOC.read_text(), re.S)
    assert match is not None, f"docs/integrations.md lost its {name} example"
    return match.group(1)


# What each example imports: the transformers example's Trainer also needs accelerate (deltasync[transformers]),
# which an environment with transformers pulled in by another package (sentence-transformers) may lack.
@pytest.mark.parametrize(("name", "needs"), [("verl", ("verl",)), ("transformers", ("transformers", "accelerate"))])
def test_example_runs(name: str, needs: tuple[str, ...]) -> None:
    for module in needs:
        pytest.importorskip(module, reason=f"{module} is not installed here: scripts/install_verl.sh builds .venv-verl")
    namespace: dict[str, object] = {"__name__": f"docs_example_{name}"}
    exec(compile(example(name), f"{DOC}:{name}", "exec"), namespace)  # each test runs in its own directory
    assert Path(f"./{name.replace('transformers', 'hf')}-repo").is_dir()
