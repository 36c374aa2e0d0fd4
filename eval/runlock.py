"""One writer per run folder.

An orphan cluster job still running after its launcher died, the rerun that resumes it, or two users
on one folder must not append to the same results. A task holds an exclusive ``flock`` on
``<output_dir>/.lock`` while it runs; the kernel drops it when the holder exits or is killed, so a
lock left by a dead process never blocks (the file stays, naming the last holder). A second
process stops with one line naming the holder, or waits up to ``lock_wait_s`` seconds.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from snapkv.errors import InputError

LOCK_FILE = ".lock"


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "slurm_job": os.environ.get("SLURM_JOB_ID")}


@contextmanager
def run_lock(out: Path, wait_s: float = 0):
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    handle = path.open("a+")
    deadline = time.monotonic() + max(float(wait_s), 0)
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    try:
                        who = json.loads(handle.read() or "{}")
                    except ValueError:
                        who = {}
                    job = f", SLURM job {who['slurm_job']}" if who.get("slurm_job") else ""
                    raise InputError(f"output_dir={out} is in use by process {who.get('pid', '?')} on "
                                     f"{who.get('host', '?')}{job} since {who.get('since', '?')}; wait for it to "
                                     "finish (lock_wait_s=SECONDS waits), stop it, or use another output_dir") from None
                time.sleep(0.5)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()))
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock
