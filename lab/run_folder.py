"""A training run's folder: one run per folder, files written whole, a clean stop on a signal.

Not JAGG's: what a long run (lab/sd_runner.py) needs around its training loop. Each error is a
ValueError whose message is one line naming the file or flag and the fix; the trainer prints it
and exits before any work.
- claim_folder: one process holds the folder (a lock, which processes it forks do not keep); a
  folder holding another run is refused.
- atomic_write, write_json: a file is written beside its place and renamed over it, so a reader
  or a killed run sees the old file or the new one, never half of one.
- stop_on_signals: Ctrl-C, SIGTERM (a cluster's preemption) and SIGHUP (a closed terminal) end
  the run at a point where it can stop cleanly.
"""

import contextlib
import glob
import json
import math
import os
import signal
import sys
import tempfile



class WriteError(OSError):
    """atomic_write could not write a file (a full disk, say); the file it would replace stands."""


def atomic_write(path, data, mode="w"):
    """Write data (a str, bytes, or a function of the open file) into a temporary file beside path,
    then rename it over path: a reader, or a killed run, sees the old file or the new, never half.
    An OSError becomes a WriteError whose message is one line naming path."""
    folder, tmp = os.path.dirname(os.path.abspath(path)), None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, mode) as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
        os.chmod(tmp, 0o644)  # not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        # torch.save reports a full disk as a RuntimeError ("... failed writing file ...")
        full = isinstance(e, RuntimeError) and "writing file" in str(e)
        if isinstance(e, OSError) or full:
            why = getattr(e, "strerror", None) or ("the disk is full" if full else e)
            raise WriteError(f"cannot write {path} ({why}); what was there before stands") from e
        raise


def json_text(obj, indent=None):
    """JSON of obj with a non-finite number written as null: JSON has no NaN."""
    def clean(o):
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return None if isinstance(o, float) and not math.isfinite(o) else o
    return json.dumps(clean(obj), indent=indent, sort_keys=True, allow_nan=False)


def write_json(path, obj):
    atomic_write(path, json_text(obj, indent=2))


def claim_folder(out, run_files, resume=False, overwrite=False, resume_command=None):
    """Lock the folder out for this process (the lock holds until the returned file is closed) and
    check it may take a run: one that another process holds, that cannot be written, or that holds
    a run (any of run_files: paths inside out, glob patterns) without resume or overwrite is
    refused, naming resume_command, the command that continues that run (None: it cannot be).
    Removes the temporary files of a killed write; with overwrite, the old run's files. The lock
    file holds this process's id; a process it forks (a reward's workers) closes its copy."""
    import fcntl  # POSIX only, and only here: the toy demo writes its files on Windows too

    path = os.path.join(out, ".lock")
    try:
        os.makedirs(out, exist_ok=True)
        lock = open(path, "a+")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()  # "pid (command line)" of the run that locked it
        lock.close()
        pid = holder.split()[0] if holder else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            raise ValueError(f"--out {out!r} is locked by a process that the ended process {pid} "
                             f"started (a reward's worker, say): find it with `fuser {path}`, end "
                             "it, or pick another folder") from None
        holder = f"process {holder}" if holder else "another process"
        raise ValueError(f"--out {out!r} is in use by {holder} (it holds {path}): wait for it, or "
                         "pick another folder") from None
    except OSError as e:
        raise ValueError(f"--out {out!r} cannot be created or written to ({e.strerror or e}); "
                         "pass a writable folder") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()} ({' '.join(sys.argv)[:200]})\n")
    lock.flush()
    os.register_at_fork(after_in_child=lock.close)  # a fork would hold the lock past this run

    def inside(pattern):
        return glob.glob(os.path.join(glob.escape(out), pattern))
    found = sorted({os.path.relpath(path, out) for name in run_files for path in inside(name)})
    if found and not resume and not overwrite:
        release(lock)
        go_on = f"continue it with {resume_command}, " if resume_command else ""
        raise ValueError(f"--out {out!r} holds a run ({', '.join(found)}): {go_on}start afresh "
                         "with --overwrite, or pick another folder")
    for tmp in inside(".tmp-*") + inside("*/.tmp-*"):
        os.remove(tmp)
    for name in found if overwrite else ():
        os.remove(os.path.join(out, name))
    return lock


def release(lock):
    """Free a folder claim_folder locked: its lock file emptied (no process id left), closed."""
    lock.seek(0)
    lock.truncate()
    lock.close()


@contextlib.contextmanager
def stop_on_signals():
    """Inside, Ctrl-C (SIGINT), SIGTERM and SIGHUP are recorded in the yielded list instead of
    stopping the process, so that a trainer stops where it can stop cleanly; a second signal of
    the same kind acts at once (Ctrl-C: KeyboardInterrupt)."""
    received = []

    def handler(signum, frame):
        received.append(signal.Signals(signum).name)
        again = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, again)
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
