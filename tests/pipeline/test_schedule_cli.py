"""scripts/pipeline_schedule.py, and the grids docs/pipeline-parallelism.md shows.

What this proves: the command's JSON carries the simulator's numbers (1F1B at p = 4,
m = 8: bubble 3/11, 9 idle per rank, peaks 4 3 2 1) and each rank's list, which reads
back; a combination the schedule cannot run exits 2 naming the flags; the command runs
without importing torch; and every grid in the doc's "Schedules" section is exactly
what the command prints now (each block starts with the command line that made it).
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from hybrid.pipeline.actions import parse_actions
from tests.helpers.launch import ROOT, env, script_module

DOC = pathlib.Path(ROOT) / "docs" / "pipeline-parallelism.md"
COMMAND = "$ python scripts/pipeline_schedule.py "


@pytest.fixture(scope="module")
def cli():
    return script_module("pipeline_schedule")


def test_json_carries_the_simulation(cli, capsys):
    assert cli.main(["--schedule", "1f1b", "-p", "4", "-m", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["schedule"], record["p"], record["m"], record["v"]) == ("1f1b", 4, 8, 1)
    assert record["times"] == {"forward": 1, "backward_input": 1, "backward_weight": 1,
                               "comm": 0}
    assert record["step_time"] == 33 and record["idle"] == [9] * 4
    assert record["bubble_exact"] == "3/11" and record["bubble"] == pytest.approx(3 / 11)
    assert record["peak_held"] == [4, 3, 2, 1] == record["peak_held_per_stage"]
    assert len(record["grid"]) == 5 and record["grid"][1].startswith("rank 0 |F0 F1 F2 F3")
    assert [len(parse_actions(line)) for line in record["actions"]] == [33, 49, 49, 33]


def test_times_and_virtual_size_reach_the_simulation(cli, capsys):
    cli.main(["--schedule", "1f1b", "-p", "4", "-m", "8", "-v", "2", "--times", "2,0.5,0.5",
              "--comm", "0", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert record["schedule"] == "interleaved_1f1b"  # 1f1b with v > 1, as in training
    assert record["times"]["backward_input"] == 0.5
    assert record["bubble_exact"] == "3/19"  # (p-1)/(v m + p - 1)


def test_a_combination_it_cannot_run_exits_2_naming_the_flags(cli, capsys):
    assert cli.main(["--schedule", "interleaved_1f1b", "-p", "4", "-m", "6", "-v", "2"]) == 2
    err = capsys.readouterr().err
    assert "--virtual-pipeline-model-parallel-size 2" in err and "--global-batch-size" in err


def test_the_command_runs_without_torch():
    code = ("import runpy, sys\n"
            "sys.argv = ['pipeline_schedule.py', '--schedule', 'zb_h1', '--json']\n"
            "try:\n"
            "    runpy.run_path('scripts/pipeline_schedule.py', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(),
                          capture_output=True, check=False, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bubble_exact"] == "1/9"


def _doc_blocks() -> list[tuple[str, str]]:
    """(arguments, printed text) of each command block in the doc's Schedules section."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("\n## Schedules\n"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    blocks = re.findall(r"```text\n(.*?)```", section, re.S)
    return [(b.split("\n", 1)[0][len(COMMAND):], b.split("\n", 1)[1])
            for b in blocks if b.startswith(COMMAND)]


def test_the_docs_grids_are_what_the_simulator_prints(cli, capsys):
    blocks = _doc_blocks()
    shown = {shlex.split(args)[1] for args, _ in blocks}
    assert shown == {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}
    for args, printed in blocks:
        assert cli.main(shlex.split(args)) == 0
        assert capsys.readouterr().out == printed, f"docs/pipeline-parallelism.md: {args}"
