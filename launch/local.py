"""Local multi-process launcher: N processes x M CPU devices on one machine, collectives over gloo.

    python launch/local.py --processes 2 --devices-per-process 2 -- \
        dspark-jax train --config configs/tiny.py mesh=data=4

Each child gets DSPARK_COORDINATOR_ADDRESS / DSPARK_NUM_PROCESSES / DSPARK_PROCESS_ID (read by
`dspark-jax train`, `generate` and `eval`, which call jax.distributed.initialize and selects gloo CPU collectives),
JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=M. Output of process i
goes to <log-dir>/process_<i>.log, and process 0's also to this terminal. Exit code: the first
non-zero child exit code, else 0; if one child fails the others are terminated and the failing
process's last lines are printed.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, log, echo, tail: collections.deque) -> None:
    """Copy a child's output line by line to its log file (and the terminal for process 0),
    keeping the last lines in ``tail``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        tail.append(line)
        if log:
            log.write(line)
            log.flush()
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()
    stream.close()
    if log:
        log.close()


def _wait(children, deadline) -> tuple[int, int | None]:
    """(exit code, first failing process or None): poll until all exit; the first failure
    terminates the others; past ``deadline`` all are killed (code 124)."""
    code, first_bad = 0, None
    while True:
        states = [c.poll() for c in children]
        bad = [(i, s) for i, s in enumerate(states) if s not in (None, 0)]
        if bad and code == 0:
            first_bad, code = bad[0]
            for c in children:
                if c.poll() is None:
                    c.terminate()
        if all(s is not None for s in states):
            break
        if deadline and time.time() > deadline:
            for c in children:
                if c.poll() is None:
                    c.kill()
            code = 124
            break
        time.sleep(0.2)
    return code, first_bad


def launch(command: list[str], processes: int, devices_per_process: int, log_dir: str | None = None,
           port: int | None = None, env: dict | None = None, timeout: float | None = None,
           tail_lines: int = 20) -> int:
    port = port or free_port()
    logs = Path(log_dir) if log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    children, pumps, tails = [], [], []
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
        child = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log = (logs / f"process_{i}.log").open("w", encoding="utf-8") if logs else None
        tails.append(collections.deque(maxlen=tail_lines))
        pumps.append(threading.Thread(target=_pump, args=(child.stdout, log, i == 0, tails[-1]), daemon=True))
        pumps[-1].start()
        children.append(child)
    deadline = None if timeout is None else time.time() + timeout
    try:
        code, first_bad = _wait(children, deadline)
    except KeyboardInterrupt:  # Ctrl-C: the children got it too; end them all, then say so
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(timeout=10)
            except subprocess.TimeoutExpired:
                c.kill()
        print("interrupted", file=sys.stderr)
        return 130
    for c in children:
        c.wait()
    for t in pumps:
        t.join(timeout=5)
    if first_bad is not None and code != 124:
        where = f" ({logs / f'process_{first_bad}.log'})" if logs else ""
        print(f"launch/local.py: process {first_bad} failed first (exit code {code}); its last lines{where}:",
              file=sys.stderr)
        if first_bad != 0 or not tails[first_bad]:
            sys.stderr.write("".join(f"  | {line}" for line in tails[first_bad]))
        else:
            print("  (process 0: shown above)", file=sys.stderr)
    return code


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
    for flag, value in (("--processes", args.processes), ("--devices-per-process", args.devices_per_process)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    import shutil
    if shutil.which(cmd[0]) is None:
        ap.error(f"command {cmd[0]!r} not found (not an executable on PATH)")
    return launch(cmd, args.processes, args.devices_per_process, args.log_dir, args.port)


if __name__ == "__main__":
    sys.exit(main())
