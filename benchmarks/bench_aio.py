"""Swap-file bandwidth of hybrid's async I/O beside the disk's own, measured by dd.

Prints one JSON object. In a scratch directory (made inside ``--dir``, removed at
the end) it writes ``--gib`` GiB from a 4096-aligned buffer into a new file and
reads it back, once per backend of :class:`hybrid.kernels.aio.AsyncIO` that runs
here ("csrc", "python"), with ``O_DIRECT`` so the page cache does not flatter
the numbers, and measures the same with ``dd bs=8M oflag=direct`` /
``iflag=direct``. Every figure is the best of ``--reps`` runs, in GB/s (1e9
bytes/s); ``ratio_to_dd`` is the backend's over dd's. Where the file system
refuses O_DIRECT both sides run buffered and ``direct`` is false (then the read
figures measure the page cache, not the disk).

    python -m benchmarks.bench_aio                      # 2 GiB in a dir under the cwd
    python -m benchmarks.bench_aio --dir /nvme --gib 8 --threads 8

The default directory is under the current directory, not /tmp: /tmp is often
tmpfs (memory), which says nothing about a disk.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile

import torch

from benchmarks.timing import Stopwatch, emit
from hybrid.config import kernel_config_from_env
from hybrid.kernels import configure
from hybrid.kernels.aio import AsyncIO, SwapFile, aio_ext, aligned_empty

BLOCK = 8 << 20  # dd's bs, and the unit the size is rounded down to


def _mount(path: str) -> tuple[str, str]:
    """(mount point, file system type) that ``path`` lives on, from /proc/mounts."""
    real, best = os.path.realpath(path), ("/", "unknown")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, point, fstype = line.split()[:3]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fstype)
    except OSError:
        pass
    return best


def _direct_ok(directory: str) -> bool:
    probe = os.path.join(directory, "probe")
    with SwapFile(probe, create=True, direct=True) as f:
        ok = f.direct
    os.unlink(probe)
    return ok


def _dd(args: list[str]) -> float:
    """Seconds dd reports for its copy (parsed from its stderr)."""
    run = subprocess.run(["dd", *args], capture_output=True, check=False, text=True,
                         env={**os.environ, "LC_ALL": "C"})
    if run.returncode != 0:
        raise RuntimeError(f"dd {' '.join(args)} failed: {run.stderr.strip()}")
    m = re.search(r"(\d+) bytes .*copied, ([0-9.e+-]+) s", run.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd's report: {run.stderr.strip()!r}")
    return float(m.group(2))


def bench_dd(directory: str, nbytes: int, direct: bool, reps: int) -> dict:
    path = os.path.join(directory, "dd.swap")
    oflag = ["oflag=direct"] if direct else ["conv=fdatasync"]
    iflag = ["iflag=direct"] if direct else []
    write, read = [], []
    for _ in range(reps):
        if os.path.exists(path):
            os.unlink(path)
        write.append(_dd(["if=/dev/zero", f"of={path}", f"bs={BLOCK}",
                          f"count={nbytes // BLOCK}", *oflag]))
        read.append(_dd([f"if={path}", "of=/dev/null", f"bs={BLOCK}", *iflag]))
    os.unlink(path)
    return {"write_GBps": nbytes / min(write) / 1e9, "read_GBps": nbytes / min(read) / 1e9}


def bench_backend(backend: str, directory: str, src: torch.Tensor, threads: int,
                  reps: int) -> dict:
    """Best write and read GB/s of one backend; checks the bytes read back."""
    path = os.path.join(directory, f"{backend}.swap")
    dst = aligned_empty(src.numel(), torch.uint8)
    write, read = [], []
    with AsyncIO(threads, backend) as io:
        for _ in range(reps):
            if os.path.exists(path):
                os.unlink(path)  # a new file each time, as dd writes one
            with SwapFile(path, create=True, direct=True) as f:
                with Stopwatch() as w:
                    io.write(f, 0, src).wait()
                dst.zero_()
                with Stopwatch() as r:
                    io.read(f, 0, dst).wait()
            write.append(w.seconds)
            read.append(r.seconds)
            if not torch.equal(src, dst):
                raise RuntimeError(f"{backend}: the bytes read back differ from those written")
    os.unlink(path)
    n = src.numel()
    return {"write_GBps": n / min(write) / 1e9, "read_GBps": n / min(read) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.getcwd(),
                    help="where the scratch directory goes (default: the current directory)")
    ap.add_argument("--gib", type=float, default=2.0, help="GiB per file (default 2)")
    ap.add_argument("--threads", type=int, default=4, help="AsyncIO threads (default 4)")
    ap.add_argument("--reps", type=int, default=2, help="runs per figure, best kept (default 2)")
    args = ap.parse_args()
    configure(kernel_config_from_env(os.environ))  # this script's entry point: HYBRID_* settings

    nbytes = max(BLOCK, int(args.gib * 2**30) // BLOCK * BLOCK)
    point, fstype = _mount(args.dir)
    report = {"dir": os.path.realpath(args.dir), "mount": point, "fs": fstype,
              "bytes": nbytes, "threads": args.threads, "reps": args.reps}
    if fstype in ("tmpfs", "ramfs"):
        report["note"] = f"{args.dir} is on {fstype} (memory): these are not disk figures"
    scratch = tempfile.mkdtemp(prefix=".bench_aio-", dir=args.dir)
    try:
        direct = _direct_ok(scratch)
        report["direct"] = direct
        if not direct:
            report["direct_note"] = (f"{fstype} refuses O_DIRECT: all runs buffered, reads "
                                     "come from the page cache")
        report["dd"] = bench_dd(scratch, nbytes, direct, args.reps)
        src = aligned_empty(nbytes, torch.uint8)
        torch.arange(nbytes // 8, dtype=torch.int64, out=src.view(torch.int64))
        backends = ["csrc", "python"] if aio_ext() is not None else ["python"]
        if "csrc" not in backends:
            report["csrc_note"] = "hybrid_cpu_ops did not load (kernels off or build failed)"
        for b in backends:
            row = bench_backend(b, scratch, src, args.threads, args.reps)
            row["ratio_to_dd"] = {k: row[k] / report["dd"][k] for k in ("write_GBps", "read_GBps")}
            report[b] = row
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    emit(report, indent=1)


if __name__ == "__main__":
    main()
