"""A snapshot of this machine for worker heartbeats: CPU, memory, and GPUs when nvidia-smi is there."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import time
from typing import Any

import psutil


def system_snapshot(include_gpu: bool = True) -> dict[str, Any]:
    mem = psutil.virtual_memory()
    snap: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "os": platform.system(),
        "cpu_cores": psutil.cpu_count(),
        "cpu_percent": psutil.cpu_percent(interval=None),
        "memory_used_gib": round(mem.used / 2**30, 2),
        "memory_total_gib": round(mem.total / 2**30, 2),
        "memory_percent": mem.percent,
        "process_rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
        "timestamp": time.time(),
    }
    if include_gpu:
        gpus = gpu_snapshot()
        if gpus:
            snap["gpus"] = gpus
    return snap


def gpu_snapshot() -> list[dict[str, Any]]:
    """Per-GPU utilisation and memory from nvidia-smi; empty when there is no NVIDIA GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = "index,name,utilization.gpu,memory.used,memory.total,temperature.gpu"
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 6:
            index, name, util, used, total, temp = fields
            gpus.append(
                {
                    "index": int(index),
                    "name": name,
                    "utilization_percent": _number(util),
                    "memory_used_mib": _number(used),
                    "memory_total_mib": _number(total),
                    "temperature_c": _number(temp),
                }
            )
    return gpus


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
