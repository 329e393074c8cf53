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
    from tensorflow.python.framework.device_spec import DeviceSpecV2
    try:
        spec = DeviceSpecV2.from_string(text.strip())
    except (ValueError, TypeError) as e:
        raise GraphxformError(f"device '{text}' is not a TF device name ({e})") from None
    if spec.device_type is None:
        raise GraphxformError(f"device '{text}' names no device type (e.g. /device:GPU:0)")
    return spec.to_string()


def cpu_devices_needed(device_names) -> int:
    """How many local CPU devices a session needs to place these devices."""
    from tensorflow.python.framework.device_spec import DeviceSpecV2
    count = 1
    for name in device_names:
        if not name:
            continue
        spec = DeviceSpecV2.from_string(name)
        if spec.device_type == "CPU" and spec.device_index is not None:
            count = max(count, spec.device_index + 1)
    return count


class Cluster:
    """A TF cluster: job name -> list of "host:port" task addresses (TensorFlow's ClusterSpec
    JSON, or the "cluster" part of TF_CONFIG)."""

    def __init__(self, jobs: dict, source: str = "cluster"):
        self.source = source
        self.jobs = {}
        if not isinstance(jobs, dict) or not jobs:
            raise GraphxformError(f"{source}: a cluster is a JSON object of jobs, e.g. "
                                  '{"ps": ["127.0.0.1:2222"], "worker": [...]}')
        for job, tasks in jobs.items():
            if isinstance(tasks, dict):  # {"0": "host:port", ...}, TF allows sparse tasks
                try:
                    tasks = [tasks[k] for k in sorted(tasks, key=int)]
                except ValueError:
                    raise GraphxformError(f"{source}: job '{job}' has a task index that is not "
                                          "a number") from None
            if not isinstance(tasks, list) or not tasks:
                raise GraphxformError(f"{source}: job '{job}' has no tasks")
            for address in tasks:
                if not isinstance(address, str) or ":" not in address:
                    raise GraphxformError(f"{source}: job '{job}' task address {address!r} is "
                                          "not host:port")
                port = address.rsplit(":", 1)[1]
                if not port.isdigit() or not 1 <= int(port) <= 65535:
                    raise GraphxformError(f"{source}: job '{job}' task address {address!r} has "
                                          "no port in 1-65535")
            self.jobs[job] = list(tasks)
        addresses = [a for tasks in self.jobs.values() for a in tasks]
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        if twice:
            raise GraphxformError(f"{source}: two tasks share the address {twice[0]}")
        if "worker" not in self.jobs and "chief" not in self.jobs:
            raise GraphxformError(f"{source}: the cluster has no 'worker' (or 'chief') job")

    def tasks(self, job: str) -> list[str]:
        return self.jobs.get(job, [])

    def require(self, job: str, task: int) -> str:
        tasks = self.tasks(job)
        if not tasks:
            raise GraphxformError(f"{self.source}: the cluster has no job '{job}'")
        if not 0 <= task < len(tasks):
            raise GraphxformError(f"{self.source}: job '{job}' has no task {task} (it has "
                                  f"{len(tasks)})")
        return tasks[task]

    def as_dict(self) -> dict:
        return {job: list(tasks) for job, tasks in self.jobs.items()}

    def worker_devices(self, replicas_per_worker: int = 1, device_type: str = "CPU") -> list:
        """One device per replica: /job:worker/task:i/device:CPU:j."""
        if replicas_per_worker < 1:
            raise GraphxformError(f"--replicas-per-worker must be at least 1, not "
                                  f"{replicas_per_worker}")
        return [f"/job:worker/task:{i}/device:{device_type}:{j}"
                for i in range(len(self.tasks("worker"))) for j in range(replicas_per_worker)]


def load_cluster(path: str | None = None, environ=None) -> tuple[Cluster, dict]:
    """The cluster from a ClusterSpec JSON file, else from TF_CONFIG. Returns (cluster, task)
    where task is TF_CONFIG's {"type": ..., "index": ...} (empty for a file)."""
    import json
    import os
    environ = os.environ if environ is None else environ
    if path:
        text = _read_cluster_file(path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraphxformError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict) and "cluster" in data:  # a TF_CONFIG-shaped file
            data = data["cluster"]
        return Cluster(data, source=path), {}
    raw = environ.get("TF_CONFIG")
    if not raw:
        raise GraphxformError("no cluster: give --cluster FILE or set TF_CONFIG")
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise GraphxformError(f"TF_CONFIG: not valid JSON ({e.msg})") from None
    if not isinstance(config, dict) or "cluster" not in config:
        raise GraphxformError('TF_CONFIG: has no "cluster"')
    cluster = Cluster(config["cluster"], source="TF_CONFIG")
    task = config.get("task") or {}
    if not isinstance(task, dict):
        raise GraphxformError(f"TF_CONFIG: task {task!r} is not {{type, index}}")
    if task:
        try:
            cluster.require(task.get("type", ""), int(task.get("index", 0)))
        except (TypeError, ValueError):
            raise GraphxformError(f"TF_CONFIG: task {task!r} is not {{type, index}}") from None
    return cluster, task


CLUSTER_FILE_LIMIT = 16 * 2**20  # a cluster of a million tasks is still a few MB of JSON


def _read_cluster_file(path: str) -> str:
    """A cluster file's text; what cannot be one (a pipe, /dev/zero, a huge or binary file)
    is a one-line error, not a wait or a read that never ends."""
    import os
    import stat
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise GraphxformError(f"{path}: not a regular file (a cluster is a JSON file)")
        if st.st_size > CLUSTER_FILE_LIMIT:
            raise GraphxformError(f"{path}: {st.st_size} bytes is too large for a cluster file")
        with open(path, "rb") as f:
            data = f.read(CLUSTER_FILE_LIMIT + 1)
    except OSError as e:
        raise GraphxformError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise GraphxformError(f"{path}: not a JSON text file (not UTF-8)") from None
