"""The GPU's SM clock, power draw and throttle reasons while steps run: ``nvidia-smi``
sampled in the background (every 20 ms), each sample given to the step whose host-side
interval holds it. Two rows that run the same kernels can then be told apart by the clock
their kernels ran at (a denser step draws more power and, at the card's power limit, runs
at a lower clock), not only by their step times."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time

FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class Sampler:
    """``with Sampler() as s: ... s.mark(row, t0, t1) ...``; afterwards ``s.by_row()``."""

    def __init__(self, period_ms: int = 20):
        self.period_ms = period_ms
        self.spans: list[tuple[str, float, float]] = []
        self.samples: list[tuple[float, float, float, float, int]] = []
        self.error: str | None = None

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.error = "nvidia-smi not found"
            self._proc = None
            return self
        self._out = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        self._proc = subprocess.Popen(
            [exe, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
             f"-lms={self.period_ms}", "-i", "0"], stdout=self._out, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        return self

    def mark(self, row: str, t0: float, t1: float) -> None:
        """Step of ``row`` ran between host times ``t0`` and ``t1`` (``time.time()``)."""
        self.spans.append((row, t0, t1))

    def __exit__(self, *exc):
        if self._proc is None:
            return
        time.sleep(0.2)
        self._proc.terminate()
        self._proc.wait()
        self._out.seek(0)
        for line in self._out:
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
                self.samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3]),
                                     int(parts[4], 16)))
            except (ValueError, IndexError):
                continue
        self._out.close()

    def by_row(self) -> dict:
        """{row: median SM MHz, median and max watts, samples, throttle reasons seen}."""
        if self.error or not self.samples:
            return {"error": self.error or "no samples"}
        out: dict = {}
        for row, t0, t1 in self.spans:
            got = [s for s in self.samples if t0 <= s[0] <= t1]
            r = out.setdefault(row, {"clock": [], "power": [], "temp": [], "reasons": 0})
            r["clock"] += [s[1] for s in got]
            r["power"] += [s[2] for s in got]
            r["temp"] += [s[3] for s in got]
            for s in got:
                r["reasons"] |= s[4]
        return {row: {"sm_mhz_median": statistics.median(r["clock"]) if r["clock"] else None,
                      "sm_mhz_mean": statistics.fmean(r["clock"]) if r["clock"] else None,
                      "watts_median": statistics.median(r["power"]) if r["power"] else None,
                      "watts_max": max(r["power"]) if r["power"] else None,
                      "temp_c_max": max(r["temp"]) if r["temp"] else None,
                      "samples": len(r["clock"]),
                      "throttle_reasons_seen": hex(r["reasons"])}
                for row, r in out.items()}
