"""The recording in ``tests/hybrid_deepspeed/recorded/`` is reproducible: the recorder, rerun
under the live DeepSpeed for one case, writes the same numbers as the committed file.
Skips, saying why, where DeepSpeed is not installed or is not the version recorded."""

from __future__ import annotations

import json

import pytest

from tests.hybrid_deepspeed.record_deepspeed import RECORDED, record, versions

# a cheap case that still takes ZeRO's partitioned path: stage 2, four steps; and the
# one with parameters the loss does not reach (DeepSpeed's ignore_unused_parameters)
CASES = ["zero2", "unused_parameters"]


@pytest.mark.peer("deepspeed")
@pytest.mark.parametrize("case", CASES)
def test_the_recorder_reproduces_the_committed_numbers(tmp_path, case):
    with open(RECORDED / f"{case}.json") as f:
        committed = json.load(f)
    installed = versions()
    if installed["deepspeed"] != committed["versions"]["deepspeed"]:
        pytest.skip(f"DeepSpeed {installed['deepspeed']} is installed, the recording is "
                    f"{committed['versions']['deepspeed']}'s")
    rerun = record([case], tmp_path, timeout=300)[case]
    assert rerun == committed
    assert (tmp_path / f"{case}.json").read_bytes() == (RECORDED / f"{case}.json").read_bytes()
