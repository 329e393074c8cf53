"""Devices for replicas: `--replicas N` (N local CPU devices, or GPUs with --gpus) or an
explicit `--devices` list; every name is checked by TF's own DeviceSpec parser."""

from __future__ import annotations

from graphxform.errors import GraphxformError


def local_devices(replicas: int | None, devices: list[str] | None) -> list[str]:
    if devices:
        parsed = [canonical_device(d) for d in devices]
        if replicas is not None and replicas != len(parsed):
            raise GraphxformError(f"--replicas {replicas} does not match the {len(parsed)} "
                                  "--devices given")
        if len(set(parsed)) != len(parsed):
            raise GraphxformError("--devices names the same device twice")
        return parsed
    if replicas is None:
        raise GraphxformError("give --replicas N or --devices")
    if replicas < 1:
        raise GraphxformError(f"--replicas must be at least 1, not {replicas}")
    return [f"/device:CPU:{i}" for i in range(replicas)]


def canonical_device(text: str) -> str:
    """'gpu:1' -> '/device:GPU:1'; refuse what TF cannot parse."""
    import tensorflow as tf
    try:
        spec = tf.DeviceSpec.from_string(text.strip())
    except (ValueError, TypeError) as e:
        raise GraphxformError(f"device '{text}' is not a TF device name ({e})") from None
    if spec.device_type is None:
        raise GraphxformError(f"device '{text}' names no device type (e.g. /device:GPU:0)")
    return spec.to_string()


def cpu_devices_needed(device_names) -> int:
    """How many local CPU devices a session needs to place these devices."""
    import tensorflow as tf
    count = 1
    for name in device_names:
        if not name:
            continue
        spec = tf.DeviceSpec.from_string(name)
        if spec.device_type == "CPU" and spec.device_index is not None:
            count = max(count, spec.device_index + 1)
    return count
