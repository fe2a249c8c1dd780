"""The peak resident memory of a process during a block of code: what every bench record reports
(the bench's own process for tierspec's methods, a peer's worker process for llama.cpp and OpenVINO)."""

from __future__ import annotations


class PeakRSS:
    """Peak resident memory (MiB) of this process during the block, from the kernel's
    high-water mark (VmHWM), which writing "5" to /proc/self/clear_refs resets to the current
    size before the block. No sampling thread competes with the timed generation. Where the
    reset is not allowed, the larger of the sizes before and after the block (a lower bound;
    ``exact`` is then False)."""

    def __init__(self):
        self.peak = 0.0
        self.exact = False

    @staticmethod
    def _status(field: str) -> float:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB → MiB
        raise OSError(f"{field} missing from /proc/self/status")

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.exact = True
        except OSError:
            self.exact = False
        try:
            self.before = self._status("VmRSS")
        except OSError:
            self.before = 0.0
        return self

    def __exit__(self, *exc):
        try:
            self.peak = self._status("VmHWM") if self.exact else max(self.before, self._status("VmRSS"))
        except OSError:
            self.peak = self.before
