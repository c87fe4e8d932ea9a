"""Turn SIGTERM / SIGINT into a request to stop after the current step.

Preemption (SIGTERM) and Ctrl-C (SIGINT) set a flag instead of killing the process; the
loop finishes its step, checkpoints and exits with EXIT_INTERRUPTED. A second signal while
stopping falls back to the default behaviour (immediate exit).
"""
import signal

EXIT_COMPLETED = 0
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 4


class StopRequest:
    def __init__(self):
        self.signal = None
        self._previous = {}

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.signal = signal.Signals(signum).name

    @property
    def requested(self):
        return self.signal is not None

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
