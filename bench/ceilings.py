"""The machine's ceilings: what moving bytes costs here, without peerckpt.

    python bench/ceilings.py [--runs 5] [--quick]

* memcpy: one 1 GiB tensor ``copy_`` between two touched buffers, one thread (what a
  snapshot copy can reach);
* crc32c: one pass over a touched 1 GiB buffer (the checksum the agents compute);
* loopback TCP: one connection, ``sendall`` of 64 MiB pieces, ``recv_into`` a buffer, 1 GiB
  (the link the agents replicate over here);
* local disk: 1 GiB written in 16 MiB pieces to a new file, then fsync (into new files:
  a durable flush always writes a new step).

Each is the median of ``--runs``. Results: ``bench/results/ceilings.json``; keys
``memcpy_gbps``, ``crc32c_gbps``, ``socket_gbps``, ``disk_write_gbps`` and their runs.
The other benchmarks measure the ceiling they compare with in their own run; these are the
reference for the table in ``docs/performance.md``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    background_load,
    bench_parser,
    crc32c_gbps,
    disk_write_direct_gbps,
    disk_write_gbps,
    median_of,
    memcpy_gbps,
    scratch_dir,
    socket_gbps,
    write_result,
)


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    nbytes = (256 << 20) if args.quick else (1 << 30)
    load = background_load()
    print(f"background load before starting: {load}", flush=True)
    result: dict[str, Any] = {"bytes": nbytes, "runs": runs, "quick": args.quick}
    # Each helper takes its own median; the runs are repeated here to keep every value.
    for name, fn in (
        ("memcpy_gbps", lambda: memcpy_gbps(nbytes, runs=1)),
        ("crc32c_gbps", lambda: crc32c_gbps(nbytes, runs=1)),
        ("socket_gbps", lambda: socket_gbps(nbytes, runs=1)),
    ):
        median, values = median_of(runs, fn)
        result[name], result[f"{name}_runs"] = median, values
        print(f"{name:16} {median:6.2f}  (runs {[round(v, 2) for v in values]})", flush=True)
    with scratch_dir("ceilings") as scratch:
        files = [Path(scratch) / f"write-{i}.bin" for i in range(runs)]
        # Every file is kept until the end: a virtual disk may rewrite blocks the filesystem
        # just freed several times faster than fresh ones (bench/flush.py measures both).
        values = [disk_write_gbps(path, nbytes) for path in files]
        result["disk_write_gbps"] = statistics.median(values)
        result["disk_write_gbps_runs"] = values
        # O_DIRECT (no page cache), as the durable tier writes local files.
        direct = [disk_write_direct_gbps(path.with_suffix(".direct"), nbytes) for path in files]
        result["disk_write_direct_gbps"] = statistics.median(direct)
        result["disk_write_direct_gbps_runs"] = direct
    print(f"{'disk_write_gbps':16} {result['disk_write_gbps']:6.2f}  (runs {values})")
    print(f"{'disk_write_direct':16} {result['disk_write_direct_gbps']:6.2f}  (runs {direct})")
    print(f"written {write_result('ceilings', result)}")


if __name__ == "__main__":
    main()
