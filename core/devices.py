"""The devices of this host, as the status call reports them."""

from __future__ import annotations

import glob
import os

from clusterwire.protos.service_pb2 import DeviceInfo


def gpu_count() -> int:
    """GPUs visible to this process: $CUDA_VISIBLE_DEVICES if set, else /dev/nvidiaN nodes."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def local_devices(job: str, index: int) -> list[DeviceInfo]:
    """One CPU device plus one device per visible GPU, with TF-style names."""
    prefix = f"/job:{job}/replica:0/task:{index}/device:"
    devices = [DeviceInfo(name=prefix + "CPU:0", device_type="CPU")]
    devices += [DeviceInfo(name=f"{prefix}GPU:{i}", device_type="GPU") for i in range(gpu_count())]
    return devices
