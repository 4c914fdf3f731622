"""The recording in ``tests/deepspeed/recorded/`` is reproducible: the recorder, rerun
under the live DeepSpeed for one case, writes the same numbers as the committed file.
Skips, saying why, where DeepSpeed is not installed or is not the version recorded."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.deepspeed.record_deepspeed import RECORDED, record, versions

# a cheap case that still takes ZeRO's partitioned path: stage 2, four steps
CASE = "zero2"


def test_the_recorder_reproduces_the_committed_numbers(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed: the recording cannot be rerun here "
                    "(DS_BUILD_OPS=0 pip install --no-deps deepspeed==0.19.8)")
    with open(RECORDED / f"{CASE}.json") as f:
        committed = json.load(f)
    installed = versions()
    if installed["deepspeed"] != committed["versions"]["deepspeed"]:
        pytest.skip(f"DeepSpeed {installed['deepspeed']} is installed, the recording is "
                    f"{committed['versions']['deepspeed']}'s")
    rerun = record([CASE], tmp_path, timeout=300)[CASE]
    assert rerun == committed
    assert (tmp_path / f"{CASE}.json").read_bytes() == (RECORDED / f"{CASE}.json").read_bytes()
