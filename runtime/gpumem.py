"""GPU memory in use, sampled while another process runs: NVML (the nvidia-ml-py package) when it imports and
finds a GPU, else `nvidia-smi --query-gpu=... -lms N` (one long-lived process printing a line per GPU every N
ms). On a machine with neither (a CPU-only box) `detect()` returns None and nothing is sampled.

Readings are device-wide ("memory.used"), so the engine subtracts a baseline taken just before it starts its
child: what is left is the child's footprint, its CUDA context included, provided nothing else starts on the
GPU meanwhile. Both tools number GPUs in PCI bus order; CUDA numbers them fastest-first unless
CUDA_DEVICE_ORDER=PCI_BUS_ID, which the engine sets for its child, and CUDA_VISIBLE_DEVICES renumbers them
(`cuda_to_smi_index`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from typing import Protocol
from collections.abc import Mapping

from planner import children

MiB = 1 << 20


class MemorySampler(Protocol):
    source: str                           # "nvml" or "nvidia-smi"

    def used(self) -> dict[int, int]:
        """Bytes in use now, per GPU (nvidia-smi index)."""
        ...

    def free(self) -> dict[int, int]:
        """Bytes free now, per GPU."""
        ...

    def start(self) -> None:
        """Begin sampling in the background."""
        ...

    def stop(self) -> tuple[dict[int, int], int]:
        """End sampling: (peak bytes in use per GPU since start, number of samples)."""
        ...


class NvmlSampler:
    source = "nvml"

    def __init__(self, interval_s: float = 0.05) -> None:
        import pynvml                    # nvidia-ml-py; ImportError when absent
        self._nvml = pynvml
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            raise RuntimeError("NVML sees no GPU")
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak: dict[int, int] = {}
        self._samples = 0

    def _info(self):
        return [self._nvml.nvmlDeviceGetMemoryInfo(h) for h in self._handles]

    def used(self) -> dict[int, int]:
        return {i: int(m.used) for i, m in enumerate(self._info())}

    def free(self) -> dict[int, int]:
        return {i: int(m.free) for i, m in enumerate(self._info())}

    def _sample(self) -> None:
        for i, b in self.used().items():
            self._peak[i] = max(self._peak.get(i, 0), b)
        self._samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        self._peak, self._samples = {}, 0
        self._stop.clear()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> tuple[dict[int, int], int]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return dict(self._peak), self._samples


def machine_state(sampler: MemorySampler | None) -> str:
    """One line on what else was going on (for runs whose repetitions disagree): the host's load average and,
    with NVML, each GPU's SM clock, temperature, throttle reasons and the number of processes on it."""
    parts = []
    with contextlib.suppress(OSError):       # no load average on this platform
        la = os.getloadavg()
        parts.append(f"load {la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f}")
    if isinstance(sampler, NvmlSampler):
        nv = sampler._nvml
        for i, h in enumerate(sampler._handles):
            try:
                clock = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
                temp = nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
                thr = nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)
                procs = len(nv.nvmlDeviceGetComputeRunningProcesses(h))
                parts.append(f"GPU{i} {clock} MHz {temp} C throttle 0x{thr:x} procs {procs}")
            except Exception:            # an NVML call this driver lacks: say less, never fail the run
                continue
    return "; ".join(parts)


def _parse_smi(line: str) -> tuple[int, int] | None:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2 or not parts[0].isdigit():
        return None
    try:
        return int(parts[0]), int(float(parts[1]) * MiB)
    except ValueError:
        return None


class NvidiaSmiSampler:
    source = "nvidia-smi"

    def __init__(self, interval_s: float = 0.1, exe: str = "nvidia-smi") -> None:
        self.exe = exe
        self.interval_s = interval_s
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._peak: dict[int, int] = {}
        self._samples = 0
        if not self.used():
            raise RuntimeError("nvidia-smi lists no GPU")

    def _query(self, field: str) -> dict[int, int]:
        try:
            r = children.run([self.exe, f"--query-gpu=index,{field}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        rows = [_parse_smi(line) for line in r.stdout.splitlines()] if r.returncode == 0 else []
        return {i: b for i, b in (x for x in rows if x is not None)}

    def used(self) -> dict[int, int]:
        return self._query("memory.used")

    def free(self) -> dict[int, int]:
        return self._query("memory.free")

    def _reader(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            row = _parse_smi(line)
            if row is not None:
                i, b = row
                self._peak[i] = max(self._peak.get(i, 0), b)
                self._samples += 1

    def start(self) -> None:
        self._peak, self._samples = dict(self.used()), 1
        ms = max(int(self.interval_s * 1000), 10)
        self._proc = children.popen([self.exe, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                     f"--loop-ms={ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._reader, args=(self._proc,), name="smi-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> tuple[dict[int, int], int]:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for i, b in self.used().items():          # one last reading after the child is gone is harmless
            self._peak[i] = max(self._peak.get(i, 0), b)
        return dict(self._peak), self._samples


def detect(interval_s: float = 0.05) -> MemorySampler | None:
    """NVML if nvidia-ml-py imports and sees a GPU, else nvidia-smi if it lists one, else None."""
    try:
        return NvmlSampler(interval_s)
    except Exception:                      # ImportError, NVMLError (no driver), no GPU: try the next
        pass
    exe = shutil.which("nvidia-smi")
    if exe is not None:
        try:
            return NvidiaSmiSampler(max(interval_s, 0.05), exe)
        except RuntimeError:
            pass
    return None


def gpu_summary() -> str | None:
    """The GPUs as a report names them ("2x NVIDIA H200", the first one's name), None without nvidia-smi or GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [x.strip() for x in r.stdout.splitlines() if x.strip()]
    return f"{len(names)}x {names[0]}" if r.returncode == 0 and names else None


def cuda_to_smi_index(env: Mapping[str, str] | None = None) -> dict[int, int] | None:
    """CUDA device index -> nvidia-smi index under CUDA_VISIBLE_DEVICES (a list of integers); None when it is
    unset (identity) or uses UUIDs (not mapped)."""
    env = os.environ if env is None else env
    vis = env.get("CUDA_VISIBLE_DEVICES")
    if vis is None or not vis.strip():
        return None
    parts = [p.strip() for p in vis.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        return None
    return {i: int(p) for i, p in enumerate(parts)}


def per_cuda_device(values: Mapping[int, int], env: Mapping[str, str] | None = None) -> dict[str, int]:
    """{smi index: bytes} -> {"CUDA<i>": bytes} in CUDA's numbering (see cuda_to_smi_index)."""
    m = cuda_to_smi_index(env)
    if m is None:
        return {f"CUDA{i}": b for i, b in sorted(values.items())}
    return {f"CUDA{c}": values[s] for c, s in sorted(m.items()) if s in values}


def cuda_available() -> bool:
    """torch.cuda.is_available(), importing torch only when an NVIDIA driver and torch are both present;
    False on any failure (a broken torch install must not break the demo)."""
    import importlib.util
    from pathlib import Path
    if not (Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi")):
        return False        # no NVIDIA driver: skip importing torch (seconds)
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False
