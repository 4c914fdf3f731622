"""Record DeepSpeed's numbers for the DeepSpeedExamples runs of :mod:`.runs`.

    python -m tests.hybrid_deepspeed.examples.record_examples            # every run
    python -m tests.hybrid_deepspeed.examples.record_examples --runs pipeline_pp2

Runs each under the installed DeepSpeed's own launcher on the CPU at 2 ranks and writes
``recorded/<run>.json``: the script's path and sha256, the run's arguments and
ds_config, the DeepSpeed and torch versions, each rank's losses and the printed lines
compared. Deterministic: the same versions give the same files (seeded models, synthetic
data drawn from the index, one intra-op thread). A run that fails under DeepSpeed stops
the recording with its output: the recorded numbers are DeepSpeed's, never a placeholder.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import tempfile

from tests.helpers.launch import free_port
from tests.hybrid_deepspeed.examples.runs import RECORDED, RUNS, UPSTREAM, launch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    a = ap.parse_args(argv)
    for name in a.runs.split(","):
        run = RUNS[name]
        if run.against is not None:
            print(f"{name}: held to {run.against}'s recording (DeepSpeed does not run it here)")
            continue
        with tempfile.TemporaryDirectory(prefix=f"ds_example_{name}_") as tmp:
            import pathlib
            got = launch(name, "deepspeed", pathlib.Path(tmp), port=free_port())
        script = UPSTREAM / run.script
        record = {"run": name, **dataclasses.asdict(run),
                  "setup": run.setup.__name__ if run.setup is not None else None,
                  "sha256": hashlib.sha256(script.read_bytes()).hexdigest(),
                  "versions": {p: importlib.metadata.version(p) for p in ("deepspeed", "torch")},
                  **got}
        RECORDED.mkdir(exist_ok=True)
        (RECORDED / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {len(got['ranks'][0])} losses a rank, rank 0 first "
              f"{got['ranks'][0][:1]}, last {got['ranks'][0][-1:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
