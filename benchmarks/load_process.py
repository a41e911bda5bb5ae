"""One process of benchmarks/load.py: joins the group (if several), loads the checkpoint, prints one JSON line.

    python -m benchmarks.load_process --config C --checkpoint DIR --mesh 1,2,4 [--processes 2 --process-id 0
        --coordinator HOST:PORT]

Its CPU devices come from XLA_FLAGS, set by benchmarks/load.py. The report's fields are described there.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any


def proc_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """Integer fields of a /proc file ("name: value [kB]"), kB turned into bytes."""
    out = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in names:
                value, *unit = rest.split()
                out[name] = int(value) * (1024 if unit == ["kB"] else 1)
    return out


class CountedReads:
    """Counts file_arrays' array reads (its preadv calls) and their bytes."""

    def __init__(self) -> None:
        from model_service import file_arrays

        self.calls, self.bytes, self.largest = 0, 0, 0
        self._real = file_arrays.os.preadv
        file_arrays.os.preadv = self._preadv  # this process only exists to be measured

    def _preadv(self, fd: int, buffers: Any, offset: int) -> int:
        n = self._real(fd, buffers, offset)
        self.calls, self.bytes, self.largest = self.calls + 1, self.bytes + n, max(self.largest, n)
        return n


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process, user and system
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--mesh", required=True)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default="")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    if args.processes > 1:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes,
                                   process_id=args.process_id)
    from model_service.checkpoint import load_params
    from model_service.config import MeshConfig, load_model_config
    from model_service.sharding import default_between_hosts, make_mesh

    mesh_cfg = MeshConfig.parse(args.mesh)
    between = default_between_hosts(mesh_cfg, args.processes) if args.processes > 1 else None
    mesh = make_mesh(mesh_cfg, between_hosts=between)
    cfg = load_model_config(args.config)
    reads = CountedReads()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the RSS now
    base = proc_fields("/proc/self/status", ("VmRSS",))["VmRSS"]
    io_before = proc_fields("/proc/self/io", ("rchar", "syscr"))
    began, cpu = time.monotonic(), _cpu_seconds()
    params = load_params(args.checkpoint, cfg, mesh, jnp.bfloat16, stacked=mesh_cfg.expert > 1)
    jax.block_until_ready(params)
    seconds, cpu = time.monotonic() - began, _cpu_seconds() - cpu
    peak = proc_fields("/proc/self/status", ("VmHWM",))["VmHWM"] - base
    io_after = proc_fields("/proc/self/io", ("rchar", "syscr"))
    shards = [s.data for a in jax.tree.leaves(params) for s in a.addressable_shards]
    kept = sum(s.nbytes for s in shards)
    # JAX's CPU client aliases host memory a device_put is given, so a shard's replicas may be one buffer
    distinct = sum({s.unsafe_buffer_pointer(): s.nbytes for s in shards}.values())
    report = {"process_id": jax.process_index(), "local_devices": jax.local_device_count(),
              "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
              "bytes_read": reads.bytes, "read_calls": reads.calls,
              "largest_read": reads.largest, "rchar": io_after["rchar"] - io_before["rchar"],
              "syscr": io_after["syscr"] - io_before["syscr"], "kept": kept, "kept_distinct": distinct,
              "peak_over_baseline": peak, "ratio": round(peak / distinct, 3), "baseline_rss": base}
    print(json.dumps(report), flush=True)
    return 0  # a group's processes then meet at jax.distributed's exit barrier


if __name__ == "__main__":
    sys.exit(main())
