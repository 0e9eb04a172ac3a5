"""The README's "Using it" block runs as written: extracted from README.md and launched with
``ftkit run -n 2`` (2 nodes, ``local:1,partner:1``), once without and once with rank 1
SIGKILLed at step 50; both end in success, the second after one relaunch that restored a
committed step."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.jobs import REPO, run_example

pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")


def readme_block() -> str:
    """The first python block under the README's "## Using it" heading."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Using it\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "no python block under '## Using it'"
    return match.group(1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("faults", ["", "kill:rank=1:step=50:phase=capture"])
def test_readme_loop_runs_as_written(tmp_path: Path, faults: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(readme_block())
    res = run_example(tmp_path, script, n=2, ranks_per_node=1, max_restarts=1, timeout=400,
                      FTKIT_LEVELS="local:1,partner:1", FTKIT_FAULTS=faults)
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == (2 if faults else 1) and "succeeded" in lines[-1], lines
    events = res.events()
    commits = [e["step"] for e in events if e["event"] == "commit"]
    assert max(commits) == 100, commits
    restores = [e["step"] for e in events if e["event"] == "restore"]
    assert restores[0] == 0 and (not faults or 40 <= restores[1] < 50), restores
