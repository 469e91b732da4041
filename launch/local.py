"""Local multi-process launcher: N processes x M CPU devices on one machine, collectives over gloo.

    python launch/local.py --processes 2 --devices-per-process 2 -- \
        dspark-jax train --config configs/tiny.py mesh=data=4

Each child gets DSPARK_COORDINATOR_ADDRESS / DSPARK_NUM_PROCESSES / DSPARK_PROCESS_ID (read by
`dspark-jax train`, which calls jax.distributed.initialize and selects gloo CPU collectives),
JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=M. Output of process i
goes to <log-dir>/process_<i>.log (and process 0 also to this terminal). Exit code: the first
non-zero child exit code, else 0; if one child fails the others are terminated.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], processes: int, devices_per_process: int, log_dir: str | None = None,
           port: int | None = None, env: dict | None = None, timeout: float | None = None) -> int:
    port = port or free_port()
    logs = Path(log_dir) if log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    children = []
    for i in range(processes):
        child_env = dict(os.environ if env is None else env)
        flags = [f for f in child_env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        child_env.update({
            "DSPARK_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "DSPARK_NUM_PROCESSES": str(processes),
            "DSPARK_PROCESS_ID": str(i),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"]),
        })
        out = (logs / f"process_{i}.log").open("w") if logs else (None if i == 0 else subprocess.DEVNULL)
        children.append(subprocess.Popen(command, env=child_env, stdout=out, stderr=subprocess.STDOUT))
    deadline = None if timeout is None else time.time() + timeout
    code = 0
    while True:
        states = [c.poll() for c in children]
        bad = [s for s in states if s not in (None, 0)]
        if bad and code == 0:
            code = bad[0]
            for c in children:
                if c.poll() is None:
                    c.terminate()
        if all(s is not None for s in states):
            return code
        if deadline and time.time() > deadline:
            for c in children:
                if c.poll() is None:
                    c.kill()
            return 124
        time.sleep(0.2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", "-n", type=int, default=2)
    ap.add_argument("--devices-per-process", "-m", type=int, default=1)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    return launch(cmd, args.processes, args.devices_per_process, args.log_dir, args.port)


if __name__ == "__main__":
    sys.exit(main())
