"""Shared helpers for the issue-37 experiments: logging with wall-clock stamps, process-tree cleanup."""
import os, sys, time, signal, subprocess, json

def stamp():
    return f"{time.time():.3f}"

def log(f, *parts):
    line = f"{stamp()} " + " ".join(str(p) for p in parts)
    print(line, file=f, flush=True)

def tree(pids):
    import psutil
    out = set()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.add(pid)
            out.update(c.pid for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return out

def tagged(tag):
    """Processes whose command line contains our unique per-experiment tag (their daemons are reparented)."""
    import psutil
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["cmdline"] and any(tag in a for a in p.info["cmdline"]) and p.pid != os.getpid():
                found.append(p.pid)
        except Exception:
            pass
    return found

def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT); os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
