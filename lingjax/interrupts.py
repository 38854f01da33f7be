"""Ctrl-C honoured at any point of a command, even while XLA compiles (lingjax.cli installs it for a run)."""

from __future__ import annotations

import os
import signal
import sys
import threading


class CtrlC:
    """Ctrl-C at any point: Python sees a signal only between bytecodes, so while the main thread sits in a long
    native call (XLA compiling a program) the KeyboardInterrupt waits. A thread woken by the signal's byte
    (signal.set_wakeup_fd) gives the main thread GRACE_S to raise it, then ends the process itself (status 130)."""

    GRACE_S = 1.0

    def __init__(self):
        self.read, self.write = os.pipe()
        os.set_blocking(self.write, False)
        self.seen = self.raised = 0  # signals woken for, signals the main thread raised
        self.changed = threading.Condition()
        self.previous_fd = signal.set_wakeup_fd(self.write)
        self.previous = signal.signal(signal.SIGINT, self._raise)
        threading.Thread(target=self._wait, name="lingjax-ctrl-c", daemon=True).start()

    def _raise(self, signum, frame):
        with self.changed:
            self.raised += 1
            self.changed.notify_all()
        raise KeyboardInterrupt

    def _wait(self):
        while True:
            try:
                woken = os.read(self.read, 64)
            except OSError:
                woken = b""
            if not woken:
                os.close(self.read)
                return
            with self.changed:
                self.seen += len(woken)
                if not self.changed.wait_for(lambda: self.raised >= self.seen, self.GRACE_S):
                    sys.stderr.write("\nlingjax: interrupted\n")
                    sys.stderr.flush()
                    os._exit(130)

    def stop(self):
        signal.set_wakeup_fd(self.previous_fd)
        signal.signal(signal.SIGINT, self.previous)
        os.close(self.write)


def honour_ctrl_c() -> CtrlC | None:
    """Install CtrlC in the main thread of an interactive run (not under a test's thread or without signals)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return CtrlC()
    except (ValueError, OSError):
        return None
