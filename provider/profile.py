"""Hardware profile: measured, not declared.

Matmul FLOP/s per dtype on every executor and device this machine has (onnxruntime's best
execution provider; torch on its best device when torch is installed), memory total and free,
memory bandwidth (a large copy), the GPU's name and driver through nvidia-ml-py where present,
the CPU through psutil. The network half (RTT and bandwidth to the broker) is measured when the
provider joins. A profile is cached on disk keyed by device, executor and versions, so a restart
does not measure again; `--reprofile` does.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil

from dag.cost import HardwareProfile
from files.atomic import write_atomic

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
PROFILE_VERSION = 1
MATMUL_N = 1024  # square matmul size for the FLOP/s figures
MIN_SECONDS = 0.3  # measure each figure for at least this long
COPY_BYTES = 128 * 1024 * 1024  # buffer copied to measure memory bandwidth


class ExecutorProfile(msgspec.Struct, frozen=True):
    """What one executor on one device measured."""

    executor: str  # "ort" or "torch"
    device: str  # e.g. "CPUExecutionProvider", "CUDAExecutionProvider", "cpu", "cuda:0"
    flops: dict[str, float]  # dense matmul FLOP/s per dtype that runs; absent: unsupported
    mem_bandwidth: float  # device memory bandwidth; bytes/s
    memory_bytes: int  # device memory total; bytes
    memory_free_bytes: int  # device memory free when measured; bytes


class MachineProfile(msgspec.Struct, frozen=True):
    """The whole machine as the broker sees it (network figures added at join)."""

    key: str  # what the cached profile is valid for (devices, executors, versions)
    cpu: str
    cpu_cores: int
    gpu: str | None  # GPU name, from nvidia-ml-py or torch
    gpu_driver: str | None
    executors: list[ExecutorProfile]
    measured_at: float  # unix time
    seconds: float  # time the measurement took
    version: int = PROFILE_VERSION

    def best(self, executor: str | None = None) -> ExecutorProfile:
        """The executor profile with the most fp16-or-better FLOP/s (of `executor`, if given)."""
        candidates = [e for e in self.executors if executor is None or e.executor == executor]
        if not candidates:
            raise ValueError(f"no {executor} executor was profiled on this machine")
        return max(candidates, key=lambda e: max(e.flops.values(), default=0.0))

    def hardware(
        self,
        executor: str | None = None,
        *,
        net_bandwidth: float = 0.0,
        rtt: float = 0.0,
        memory_limit: float | None = None,
    ) -> HardwareProfile:
        """The cost model's view of this machine on its best (or the given) executor."""
        e = self.best(executor)
        memory = float(
            e.memory_bytes if memory_limit is None else min(memory_limit, e.memory_bytes)
        )
        return HardwareProfile(
            name=self.gpu or self.cpu,
            flops=dict(e.flops),
            memory_bytes=memory,
            mem_bandwidth=e.mem_bandwidth,
            net_bandwidth=net_bandwidth,
            rtt=rtt,
        )


def _timed(fn: Callable[[], Any], min_seconds: float = MIN_SECONDS) -> float:
    """Seconds per call of `fn`, after one warm-up call, over at least `min_seconds`."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and calls >= 3:
            return elapsed / calls


def _matmul_model(n: int, dtype: str) -> bytes:
    import onnx
    from onnx import TensorProto, helper

    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "matmul",
        [
            helper.make_tensor_value_info("a", elem, [n, n]),
            helper.make_tensor_value_info("b", elem, [n, n]),
        ],
        [helper.make_tensor_value_info("c", elem, [n, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _ort_runner(session: Any, a: Any, device: str) -> Callable[[], Any]:
    """One matmul call. On CUDA the inputs and output stay on the device (I/O binding), so
    the time is the matmul's, not the copies over PCIe."""
    if device == "CUDAExecutionProvider":
        import onnxruntime as ort

        value = ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0)
        binding = session.io_binding()
        binding.bind_ortvalue_input("a", value)
        binding.bind_ortvalue_input("b", value)
        binding.bind_output("c", "cuda")
        return lambda: session.run_with_iobinding(binding)
    return lambda: session.run(None, {"a": a, "b": a})


def _host_memory() -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def _host_bandwidth() -> float:
    """Bytes/s of a large copy (read + write counted)."""
    src = np.ones(COPY_BYTES // 8, dtype=np.float64)
    dst = np.empty_like(src)
    seconds = _timed(lambda: np.copyto(dst, src), MIN_SECONDS / 2)
    return 2 * src.nbytes / seconds


def profile_ort(providers: list[str] | None = None) -> list[ExecutorProfile]:
    """FLOP/s of onnxruntime's chosen execution provider (one profile: the first provider)."""
    import onnxruntime as ort

    from ir.executors.ort import choose_providers

    chosen = choose_providers(providers)
    device = chosen[0]
    flops: dict[str, float] = {}
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float16"):
        try:
            session = ort.InferenceSession(_matmul_model(MATMUL_N, dtype), providers=chosen)
            a = rng.standard_normal((MATMUL_N, MATMUL_N)).astype(dtype)

            run = _ort_runner(session, a, device)
            seconds = _timed(run)
        except Exception as exc:  # an EP without this dtype: leave it out
            log.info("onnxruntime %s has no usable %s matmul: %s", device, dtype, exc)
            continue
        flops[dtype] = 2 * MATMUL_N**3 / seconds
    total, free = _host_memory()
    bandwidth = _host_bandwidth()
    if device == "CUDAExecutionProvider":
        gpu = _nvml()
        if gpu is not None:
            total, free = gpu["memory_total"], gpu["memory_free"]
        bandwidth = _cuda_bandwidth() or bandwidth
    return [ExecutorProfile("ort", device, flops, bandwidth, total, free)]


def profile_torch(device: str | None = None) -> list[ExecutorProfile]:
    """FLOP/s of torch on its best device (none if torch is not installed)."""
    try:
        import torch
    except ImportError:
        return []
    from ir.executors.torch_exec import choose_device

    dev = choose_device(device)
    flops: dict[str, float] = {}
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    for name, dtype in dtypes.items():
        if dev.type == "cpu" and name != "float32":
            continue  # CPU half-precision matmuls are emulated: slower than fp32, not a figure
        try:
            a = torch.randn(MATMUL_N, MATMUL_N, device=dev).to(dtype)

            def run(a: Any = a) -> None:
                torch.matmul(a, a)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            seconds = _timed(run)
        except Exception as exc:
            log.info("torch on %s has no usable %s matmul: %s", dev, name, exc)
            continue
        flops[name] = 2 * MATMUL_N**3 / seconds
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        bandwidth = _cuda_bandwidth() or 0.0
    else:
        total, free = _host_memory()
        bandwidth = _host_bandwidth()
    return [ExecutorProfile("torch", str(dev), flops, bandwidth, int(total), int(free))]


def _cuda_bandwidth() -> float | None:
    """Device-to-device copy bandwidth through torch, if torch sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.ones(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    return 2 * COPY_BYTES / _timed(copy, MIN_SECONDS / 2)


def _nvml() -> dict[str, Any] | None:
    """GPU name, driver and memory through nvidia-ml-py, if installed and a GPU is present."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no driver, no device
        log.info("nvidia-ml-py found no GPU: %s", exc)
        return None
    decode = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
    return {
        "name": decode(name),
        "driver": decode(driver),
        "memory_total": int(memory.total),
        "memory_free": int(memory.free),
    }


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("fusionai", "onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def cache_key(executor: str | None, device: str | None) -> str:
    """What a cached profile is valid for: the executors asked for, the devices they would
    use, and the installed versions. Any change means measuring again."""
    from ir.executors.ort import available_providers

    gpu = _nvml()
    parts = {
        "gpu": (gpu["name"], gpu["driver"], gpu["memory_total"]) if gpu else None,
        "memory_total": _host_memory()[0],
        "executor": executor or "all",
        "device": device or "auto",
        "ort_providers": available_providers(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "versions": _versions(),
    }
    return json.dumps(parts, sort_keys=True)


def measure(executor: str | None = None, device: str | None = None) -> MachineProfile:
    """Measure this machine now. `executor`: "ort", "torch" or None for both."""
    if executor not in (None, "ort", "torch"):
        raise ValueError(f"executor must be 'ort' or 'torch', got {executor!r}")
    start = time.perf_counter()
    profiles: list[ExecutorProfile] = []
    if executor in (None, "ort"):
        profiles += profile_ort(
            [device] if device and device.endswith("ExecutionProvider") else None
        )
    if executor in (None, "torch"):
        torch_device = device if device and not device.endswith("ExecutionProvider") else None
        found = profile_torch(torch_device)
        if executor == "torch" and not found:
            raise ValueError("the torch executor was asked for but torch is not installed")
        profiles += found
    gpu = _nvml()
    gpu_name = gpu["name"] if gpu else None
    if gpu_name is None:
        gpu_name = _torch_gpu_name()
    return MachineProfile(
        key=cache_key(executor, device),
        cpu=_cpu_name(),
        cpu_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        gpu=gpu_name,
        gpu_driver=gpu["driver"] if gpu else None,
        executors=profiles,
        measured_at=time.time(),
        seconds=time.perf_counter() - start,
    )


def _cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform's description elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_gpu_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def free_memory_now(e: ExecutorProfile) -> int:
    """Free memory on `e`'s device now (a cached profile's figure may be days old)."""
    if e.device in ("CUDAExecutionProvider",) or e.device.startswith("cuda"):
        gpu = _nvml()
        if gpu is not None:
            return int(gpu["memory_free"])
        try:
            import torch

            if torch.cuda.is_available():
                return int(torch.cuda.mem_get_info()[0])
        except ImportError:
            pass
        return e.memory_free_bytes
    return _host_memory()[1]


def load_or_measure(
    data_dir: Path,
    executor: str | None = None,
    device: str | None = None,
    *,
    reprofile: bool = False,
) -> tuple[MachineProfile, bool]:
    """The cached profile if it is still valid for this machine, else a fresh one (saved).
    Returns (profile, measured_now)."""
    path = data_dir / PROFILE_FILE
    key = cache_key(executor, device)
    if not reprofile and path.is_file():
        try:
            cached = msgspec.json.decode(path.read_bytes(), type=MachineProfile)
        except (msgspec.DecodeError, msgspec.ValidationError, OSError) as exc:
            log.warning("ignoring unreadable profile cache %s: %s", path, exc)
        else:
            if cached.key == key and cached.version == PROFILE_VERSION:
                return cached, False
    profile = measure(executor, device)
    # atomic: a crash leaves the old cache or the new, never half
    write_atomic(path, msgspec.json.format(msgspec.json.encode(profile), indent=2), mode=0o600)
    return profile, True


def table(profile: MachineProfile) -> str:
    """The profile as a short table for people."""
    lines = [
        f"cpu:     {profile.cpu} ({profile.cpu_cores} cores)",
        f"gpu:     {profile.gpu or 'none found'}"
        + (f" (driver {profile.gpu_driver})" if profile.gpu_driver else ""),
        f"measured in {profile.seconds:.1f} s at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(profile.measured_at))}",
        "",
        f"{'executor':8} {'device':24} {'fp32 TFLOP/s':>12} {'fp16 TFLOP/s':>12} "
        f"{'bf16 TFLOP/s':>12} {'mem GB/s':>9} {'mem GB':>7} {'free GB':>7}",
    ]

    def tf(e: ExecutorProfile, dtype: str) -> str:
        value = e.flops.get(dtype)
        return f"{value / 1e12:12.3f}" if value else f"{'-':>12}"

    for e in profile.executors:
        lines.append(
            f"{e.executor:8} {e.device:24} {tf(e, 'float32')} {tf(e, 'float16')} "
            f"{tf(e, 'bfloat16')} {e.mem_bandwidth / 1e9:9.1f} {e.memory_bytes / 1e9:7.1f} "
            f"{e.memory_free_bytes / 1e9:7.1f}"
        )
    return "\n".join(lines)
