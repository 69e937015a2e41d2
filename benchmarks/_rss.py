"""Peak RSS of this process, exactly: reset ``VmHWM`` to the current RSS, run, read ``VmHWM``
(Linux ``/proc/self/clear_refs``; shared by the benchmarks)."""

from __future__ import annotations

__all__ = ["reset_peak", "peak"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; return that baseline in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak() -> int:
    return _status_kib("VmHWM") * 1024
