"""What this machine offers lowvram: GPU, driver, Triton, managed memory, host RAM.

`probe_environment` gathers facts and never raises: every probe is optional
(pynvml, cuda-bindings, psutil may be missing; a driver may be broken) and a
failed probe leaves its field None with a note. `find_problems` turns facts plus
a profile into problems, each with a concrete fix; it is pure, so tests feed it
hand-made environments.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field

from lowvram.config import Profile

GIB = 2**30
MIB = 2**20
# lowvram's Triton kernels need Turing or newer (kernels/w4a16.MIN_COMPUTE_CAPABILITY).
MIN_TRITON_COMPUTE_CAPABILITY = (7, 5)
# Below this, pinned host pages registered by some runtimes (containers, RDMA) can fail.
MIN_COMFORTABLE_MEMLOCK_BYTES = 64 * MIB
# A desktop session holds a few hundred MiB of a small card; more than this share is worth a warning.
OTHER_PROCESSES_SHARE = 0.10


@dataclass
class GpuInfo:
    index: int
    name: str
    compute_capability: tuple[int, int] | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    num_multiprocessors: int | None = None
    # cudaDevAttrConcurrentManagedAccess / cudaDevAttrPageableMemoryAccess; None = unknown.
    concurrent_managed_access: bool | None = None
    pageable_memory_access: bool | None = None
    managed_source: str = "unknown"  # "cuda-bindings", "inferred" or "unknown"

    @property
    def can_oversubscribe(self) -> bool | None:
        """Managed memory larger than the card works only with concurrent managed access."""
        return self.concurrent_managed_access

    @property
    def sm(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else "?"


@dataclass
class Environment:
    platform: str
    python_version: str
    torch_version: str
    torch_cuda_version: str | None = None
    torch_hip_version: str | None = None
    is_wsl: bool = False
    is_windows: bool = False
    cuda_available: bool = False
    cuda_visible_devices: str | None = None
    driver_version: str | None = None
    driver_cuda_version: str | None = None
    num_nvml_gpus: int | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    triton_version: str | None = None
    triton_status: str = "not tested"  # "runs", "not tested", "missing", or "fails: ..."
    has_cuda_bindings: bool = False
    host_total_bytes: int | None = None
    host_available_bytes: int | None = None
    swap_free_bytes: int | None = None
    memlock_soft_bytes: int | None = None  # None = unlimited or unknown (see memlock_known)
    memlock_hard_bytes: int | None = None
    memlock_known: bool = False
    cuda_context_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def gpu(self) -> GpuInfo | None:
        return self.gpus[0] if self.gpus else None


@dataclass
class Problem:
    severity: str  # "error", "warning" or "info"
    message: str
    fix: str


# ---------------------------------------------------------------- probes


def _probe_nvml(env: Environment) -> list[dict]:
    """Driver facts and per-GPU memory from NVML (no CUDA context needed)."""
    try:
        import pynvml
    except ImportError:
        env.notes.append("nvidia-ml-py is not installed: driver version and per-process memory are unknown")
        return []
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        env.notes.append(f"NVML unavailable ({type(exc).__name__})")
        return []
    devices = []
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        env.driver_version = version.decode() if isinstance(version, bytes) else str(version)
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        env.driver_cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        env.num_nvml_gpus = pynvml.nvmlDeviceGetCount()
        for index in range(env.num_nvml_gpus):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append(
                {
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "total": int(memory.total),
                    "free": int(memory.free),
                    "used": int(memory.used),
                }
            )
    except Exception as exc:
        env.notes.append(f"NVML query failed ({type(exc).__name__}: {exc})")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return devices


def _probe_managed(gpu: GpuInfo, env: Environment) -> None:
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        env.has_cuda_bindings = False
    else:
        env.has_cuda_bindings = True
        try:
            attr = rt.cudaDeviceAttr
            err, concurrent = rt.cudaDeviceGetAttribute(attr.cudaDevAttrConcurrentManagedAccess, gpu.index)
            err2, pageable = rt.cudaDeviceGetAttribute(attr.cudaDevAttrPageableMemoryAccess, gpu.index)
            if int(err) == 0 and int(err2) == 0:
                gpu.concurrent_managed_access = bool(concurrent)
                gpu.pageable_memory_access = bool(pageable)
                gpu.managed_source = "cuda-bindings"
                return
        except Exception as exc:
            env.notes.append(f"cuda-bindings attribute query failed ({type(exc).__name__}: {exc})")
    # Without the runtime query: Linux drivers give Pascal+ GPUs concurrent managed
    # access; Windows and WSL2 never do.
    if gpu.compute_capability is not None:
        gpu.concurrent_managed_access = not (env.is_windows or env.is_wsl) and gpu.compute_capability >= (6, 0)
        gpu.managed_source = "inferred"


def _probe_triton(env: Environment) -> None:
    try:
        import triton
    except Exception:
        env.triton_status = "missing"
        return
    env.triton_version = getattr(triton, "__version__", "?")
    gpu = env.gpu
    if not env.cuda_available or gpu is None:
        env.triton_status = "not tested (no CUDA GPU)"
        return
    if gpu.compute_capability is not None and gpu.compute_capability < MIN_TRITON_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_TRITON_COMPUTE_CAPABILITY))
        env.triton_status = f"fails: compute capability {gpu.sm} is below {need}"
        return
    try:
        import torch

        from lowvram.kernels.kv_quant import allocate_pages
        from lowvram.kernels.paged_attention import paged_decode_attention

        # One sequence of 16 tokens, one KV head: compiles and runs the decode kernel.
        pages = allocate_pages(1, 16, 1, 16, "fp16", torch.float16, "cuda")
        q = torch.zeros(1, 1, 16, dtype=torch.float16, device="cuda")
        tables = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
        lens = torch.full((1,), 16, dtype=torch.int32, device="cuda")
        paged_decode_attention(q, pages, tables, lens, 0.25)
        torch.cuda.synchronize()
        env.triton_status = "runs"
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        env.triton_status = f"fails: {type(exc).__name__}: {first_line}"


def _probe_host(env: Environment) -> None:
    try:
        import psutil

        memory = psutil.virtual_memory()
        env.host_total_bytes, env.host_available_bytes = int(memory.total), int(memory.available)
        env.swap_free_bytes = int(psutil.swap_memory().free)
    except Exception as exc:
        env.notes.append(f"host memory unknown ({type(exc).__name__})")
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        infinity = resource.RLIM_INFINITY
        env.memlock_soft_bytes = None if soft == infinity else int(soft)
        env.memlock_hard_bytes = None if hard == infinity else int(hard)
        env.memlock_known = True
    except (ImportError, OSError, ValueError, AttributeError):
        pass  # Windows has no RLIMIT_MEMLOCK


def measure_cuda_context_bytes(device: int = 0) -> int | None:
    """Device memory this process holds outside torch's allocator (the CUDA context).

    Must run before this process touches CUDA: it reads the card's used memory from
    NVML, creates the context, and subtracts what torch reserved. Returns None when
    NVML is missing or CUDA was already initialised. On a card shared with busy
    processes the number is noisy.
    """
    import torch

    if not torch.cuda.is_available() or torch.cuda.is_initialized():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        used_before = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        return None
    try:
        torch.empty(1, device=f"cuda:{device}")
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        used_after = int(total - free)
        return max(0, used_after - used_before - int(torch.cuda.memory_reserved(device)))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def probe_environment(*, test_triton: bool = True, measure_context: bool = True) -> Environment:
    """Facts about this machine; never raises (failed probes leave None and a note)."""
    import torch

    uname = platform.uname()
    env = Environment(
        platform=f"{uname.system} {uname.release} {uname.machine}",
        python_version=platform.python_version(),
        torch_version=torch.__version__,
        torch_cuda_version=getattr(torch.version, "cuda", None),
        torch_hip_version=getattr(torch.version, "hip", None),
        is_wsl="microsoft" in uname.release.lower(),
        is_windows=sys.platform.startswith("win"),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    nvml_devices = _probe_nvml(env)
    if measure_context:
        try:
            env.cuda_context_bytes = measure_cuda_context_bytes()
        except Exception as exc:
            env.notes.append(f"could not measure the CUDA context ({type(exc).__name__}: {exc})")
    try:
        env.cuda_available = torch.cuda.is_available()
        for index in range(torch.cuda.device_count() if env.cuda_available else 0):
            props = torch.cuda.get_device_properties(index)
            gpu = GpuInfo(
                index,
                props.name,
                (props.major, props.minor),
                int(props.total_memory),
                num_multiprocessors=props.multi_processor_count,
            )
            try:
                free, _ = torch.cuda.mem_get_info(index)
                gpu.free_bytes = int(free)
            except Exception:
                if index < len(nvml_devices):
                    gpu.free_bytes = nvml_devices[index]["free"]
            _probe_managed(gpu, env)
            env.gpus.append(gpu)
    except Exception as exc:
        env.notes.append(f"CUDA query failed ({type(exc).__name__}: {exc})")
    if test_triton:
        _probe_triton(env)
    else:
        try:
            import triton

            env.triton_version = getattr(triton, "__version__", "?")
        except Exception:
            env.triton_status = "missing"
    _probe_host(env)
    return env


# ---------------------------------------------------------------- problems


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(text).split(".")[:2])
    except (TypeError, ValueError):
        return None


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def find_problems(env: Environment, profile: Profile, device_type: str) -> list[Problem]:
    """Everything on this machine that will stop or slow a run with `profile` on
    `device_type`, each with a concrete fix; errors first."""
    problems: list[Problem] = []
    wants_cuda = device_type == "cuda"
    gpu = env.gpu

    if not env.cuda_available:
        sees_gpu = bool(env.num_nvml_gpus)
        if env.torch_cuda_version is None and env.torch_hip_version is None and sees_gpu:
            problems.append(
                Problem(
                    "error" if wants_cuda else "warning",
                    f"torch {env.torch_version} is a CPU-only build, but the driver sees {env.num_nvml_gpus} NVIDIA GPU(s)",
                    "install a CUDA build of torch: pip install torch --index-url https://download.pytorch.org/whl/cu126 "
                    f"(the driver supports CUDA {env.driver_cuda_version or '?'}; pick a wheel at or below it)",
                )
            )
        elif env.cuda_visible_devices is not None and env.cuda_visible_devices.strip() in ("", "-1"):
            problems.append(
                Problem(
                    "error" if wants_cuda else "info",
                    f"CUDA_VISIBLE_DEVICES={env.cuda_visible_devices!r} hides every GPU",
                    "unset CUDA_VISIBLE_DEVICES or set it to a GPU index (e.g. 0)",
                )
            )
        elif env.torch_cuda_version is not None and not sees_gpu:
            problems.append(
                Problem(
                    "error" if wants_cuda else "info",
                    "torch has CUDA support but no GPU or NVIDIA driver was found",
                    "install the NVIDIA driver (nvidia-smi must list the GPU), or run on the CPU: --profile cpu",
                )
            )
        elif wants_cuda:
            problems.append(
                Problem("error", "no CUDA GPU is visible to torch", "run on the CPU: --profile cpu (or --device cpu)")
            )

    driver = _version_tuple(env.driver_cuda_version)
    runtime = _version_tuple(env.torch_cuda_version)
    if driver and runtime and driver[0] < runtime[0]:
        problems.append(
            Problem(
                "error",
                f"the NVIDIA driver {env.driver_version} supports CUDA {env.driver_cuda_version}, older than torch's "
                f"CUDA {env.torch_cuda_version}",
                f"update the NVIDIA driver, or install a torch wheel built for CUDA {driver[0]}.x",
            )
        )

    if gpu is not None and wants_cuda:
        if env.triton_status == "missing":
            problems.append(
                Problem(
                    "warning",
                    "Triton is not installed: attention and INT4 layers use the slower plain-torch paths, "
                    "whose attention workspace grows with the context (the plan counts it)",
                    "pip install triton-windows" if env.is_windows else "pip install triton",
                )
            )
        elif env.triton_status.startswith("fails"):
            problems.append(
                Problem(
                    "error",
                    f"Triton kernels do not run on {gpu.name} ({env.triton_status[len('fails: ') :]})",
                    "use a GPU of compute capability 7.5 or newer, or update triton and the driver; "
                    "on the CPU: --profile cpu",
                )
            )
        card_bytes = int(profile.memory_budget_gib * GIB)
        if profile.emulate_vram_gib is None and gpu.total_bytes is not None and gpu.total_bytes < card_bytes * 0.97:
            fitting = max(0.25, gpu.total_bytes / GIB * 0.95)
            problems.append(
                Problem(
                    "error",
                    f"profile {profile.name!r} plans for a {profile.memory_budget_gib:g} GiB card but "
                    f"{gpu.name} has {_gib(gpu.total_bytes)}",
                    f"pick a smaller profile (e.g. --profile {_smaller_profile(gpu.total_bytes)}) or set "
                    f"memory_budget_gib: {fitting:.1f}",
                )
            )
        elif gpu.free_bytes is not None and gpu.total_bytes is not None:
            budget = profile.emulate_vram_gib or profile.memory_budget_gib
            busy = gpu.total_bytes - gpu.free_bytes - (env.cuda_context_bytes or 0)
            if gpu.free_bytes < budget * GIB and busy > OTHER_PROCESSES_SHARE * gpu.total_bytes:
                problems.append(
                    Problem(
                        "warning",
                        f"other processes use {_gib(busy)} of {gpu.name}; only {_gib(gpu.free_bytes)} is free "
                        f"for a {budget:g} GiB plan",
                        f"close them (nvidia-smi lists them) or plan for less: memory_budget_gib: "
                        f"{max(0.25, gpu.free_bytes / GIB * 0.95):.1f}",
                    )
                )
        wants_um = profile.kv_backend in ("um", "auto")
        if gpu.concurrent_managed_access is False and wants_um:
            where = "Windows" if env.is_windows else "WSL2" if env.is_wsl else "this GPU"
            problems.append(
                Problem(
                    "error" if profile.allow_oversubscription else "warning",
                    f"unified memory cannot oversubscribe the card on {where} (no concurrent managed access): "
                    "KV pages cannot spill to host RAM through managed memory",
                    "kv_backend: pinned"
                    + ("  and  allow_oversubscription: false" if profile.allow_oversubscription else ""),
                )
            )
        if not env.has_cuda_bindings and profile.kv_backend == "um":
            problems.append(
                Problem(
                    "warning",
                    "cuda-bindings is not installed: the unified-memory KV pool is unavailable",
                    "pip install 'lowvram[um]'  (or kv_backend: pinned)",
                )
            )

    if (
        env.host_available_bytes is not None
        and profile.host_spill_gib > 0
        and env.host_available_bytes < profile.host_spill_gib * GIB
    ):
        problems.append(
            Problem(
                "warning",
                f"the profile may spill {profile.host_spill_gib:g} GiB of KV to host RAM but only "
                f"{_gib(env.host_available_bytes)} is available",
                f"host_spill_gib: {max(0.0, env.host_available_bytes / GIB * 0.5):.1f}",
            )
        )
    if (
        wants_cuda
        and env.memlock_known
        and env.memlock_soft_bytes is not None
        and env.memlock_soft_bytes < MIN_COMFORTABLE_MEMLOCK_BYTES
        and profile.kv_backend in ("pinned", "auto")
    ):
        problems.append(
            Problem(
                "info",
                f"the locked-memory limit (ulimit -l) is {env.memlock_soft_bytes // 1024} KiB; some container "
                "runtimes apply it to pinned host buffers",
                "if pinned allocations fail: ulimit -l unlimited (docker: --ulimit memlock=-1)",
            )
        )
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(problems, key=lambda p: order[p.severity])


def _smaller_profile(total_bytes: int) -> str:
    for name, gib in (("8gb", 8), ("6gb", 6), ("4gb", 4)):
        if total_bytes >= gib * GIB * 0.97:
            return name
    return "2gb"
