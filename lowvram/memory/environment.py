"""What this machine offers lowvram (GPU, driver, Triton, managed memory, host RAM), and
the problems that will stop or slow a run there."""

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


def _probe_nvml(env: Environment) -> list[int]:
    """Driver facts from NVML (no CUDA context needed); each GPU's free bytes."""
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
    free = []
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        env.driver_version = version.decode() if isinstance(version, bytes) else str(version)
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        env.driver_cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        env.num_nvml_gpus = pynvml.nvmlDeviceGetCount()
        for index in range(env.num_nvml_gpus):
            free.append(int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free))
    except Exception as exc:
        env.notes.append(f"NVML query failed ({type(exc).__name__}: {exc})")
    finally:
        _nvml_shutdown(pynvml)
    return free


def _nvml_shutdown(pynvml) -> None:
    try:
        pynvml.nvmlShutdown()
    except Exception:
        pass


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
                gpu.concurrent_managed_access, gpu.pageable_memory_access = bool(concurrent), bool(pageable)
                gpu.managed_source = "cuda-bindings"
                return
        except Exception as exc:
            env.notes.append(f"cuda-bindings attribute query failed ({type(exc).__name__}: {exc})")
    # Without the runtime query: Linux drivers give Pascal+ GPUs concurrent managed access; Windows and WSL2 never do.
    if gpu.compute_capability is not None:
        gpu.concurrent_managed_access = not (env.is_windows or env.is_wsl) and gpu.compute_capability >= (6, 0)
        gpu.managed_source = "inferred"


def _probe_triton(env: Environment, test_kernels: bool) -> None:
    try:
        import triton
    except Exception:
        env.triton_status = "missing"
        return
    env.triton_version, gpu = triton.__version__, env.gpu
    if not test_kernels:
        return
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


def measure_cuda_context_bytes(device: int = 0) -> int | None:
    """Device memory this process holds outside torch's allocator (the CUDA context): the
    card's used memory before and after creating the context, less what torch reserved.
    Must run before the process touches CUDA; None without NVML or after CUDA started."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.is_initialized():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        used_before = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device)).used)
    except Exception:
        return None
    try:
        torch.empty(1, device=f"cuda:{device}")
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(total - free) - used_before - int(torch.cuda.memory_reserved(device)))
    finally:
        _nvml_shutdown(pynvml)


def probe_environment(*, test_triton: bool = True, measure_context: bool = True) -> Environment:
    """Facts about this machine; never raises (failed probes leave None and a note)."""
    import torch

    uname = platform.uname()
    env = Environment(
        f"{uname.system} {uname.release} {uname.machine}",
        platform.python_version(),
        torch.__version__,
        torch.version.cuda,
        torch.version.hip,
        is_wsl="microsoft" in uname.release.lower(),
        is_windows=sys.platform.startswith("win"),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    nvml_free = _probe_nvml(env)
    if measure_context:
        try:
            env.cuda_context_bytes = measure_cuda_context_bytes()
        except Exception as exc:
            env.notes.append(f"could not measure the CUDA context ({type(exc).__name__}: {exc})")
    try:
        env.cuda_available = torch.cuda.is_available()
        for index in range(torch.cuda.device_count() if env.cuda_available else 0):
            props = torch.cuda.get_device_properties(index)
            gpu = GpuInfo(index, props.name, (props.major, props.minor), props.total_memory)
            gpu.num_multiprocessors = props.multi_processor_count
            try:
                gpu.free_bytes = int(torch.cuda.mem_get_info(index)[0])
            except Exception:
                gpu.free_bytes = nvml_free[index] if index < len(nvml_free) else None
            _probe_managed(gpu, env)
            env.gpus.append(gpu)
    except Exception as exc:
        env.notes.append(f"CUDA query failed ({type(exc).__name__}: {exc})")
    _probe_triton(env, test_kernels=test_triton)
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
        env.memlock_soft_bytes = None if soft == resource.RLIM_INFINITY else int(soft)
        env.memlock_hard_bytes = None if hard == resource.RLIM_INFINITY else int(hard)
        env.memlock_known = True
    except (ImportError, OSError, ValueError, AttributeError):
        pass  # Windows has no RLIMIT_MEMLOCK
    return env


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def _fitting_budget(free_bytes: float) -> str:
    """A memory_budget_gib that leaves 5% of `free_bytes` spare."""
    return f"memory_budget_gib: {max(0.25, free_bytes / GIB * 0.95):.1f}"


def find_problems(env: Environment, profile: Profile, device_type: str) -> list[Problem]:
    """Everything here that will stop or slow a run with `profile` on `device_type`, each
    with a concrete fix; errors first."""
    problems: list[Problem] = []
    wants_cuda, gpu = device_type == "cuda", env.gpu

    def add(severity: str, message: str, fix: str) -> None:
        problems.append(Problem(severity, message, fix))

    if not env.cuda_available:
        sees_gpu = bool(env.num_nvml_gpus)
        hidden = env.cuda_visible_devices is not None and env.cuda_visible_devices.strip() in ("", "-1")
        if env.torch_cuda_version is None and env.torch_hip_version is None and sees_gpu:
            add(
                "error" if wants_cuda else "warning",
                f"torch {env.torch_version} is a CPU-only build, but the driver sees {env.num_nvml_gpus} NVIDIA GPU(s)",
                "install a CUDA build of torch: pip install torch --index-url https://download.pytorch.org/whl/cu126 "
                f"(the driver supports CUDA {env.driver_cuda_version or '?'}; pick a wheel at or below it)",
            )
        elif hidden:
            add(
                "error" if wants_cuda else "info",
                f"CUDA_VISIBLE_DEVICES={env.cuda_visible_devices!r} hides every GPU",
                "unset CUDA_VISIBLE_DEVICES or set it to a GPU index (e.g. 0)",
            )
        elif env.torch_cuda_version is not None and not sees_gpu:
            add(
                "error" if wants_cuda else "info",
                "torch has CUDA support but no GPU or NVIDIA driver was found",
                "install the NVIDIA driver (nvidia-smi must list the GPU), or run on the CPU: --profile cpu",
            )
        elif wants_cuda:
            add("error", "no CUDA GPU is visible to torch", "run on the CPU: --profile cpu (or --device cpu)")
    try:
        driver, runtime = (int(str(v).split(".")[0]) for v in (env.driver_cuda_version, env.torch_cuda_version))
    except ValueError:
        driver = runtime = None
    if driver and runtime and driver < runtime:
        add(
            "error",
            f"the NVIDIA driver {env.driver_version} supports CUDA {env.driver_cuda_version}, older than torch's "
            f"CUDA {env.torch_cuda_version}",
            f"update the NVIDIA driver, or install a torch wheel built for CUDA {driver}.x",
        )
    if gpu is not None and wants_cuda:
        if env.triton_status == "missing":
            add(
                "warning",
                "Triton is not installed: attention and INT4 layers use the slower plain-torch paths, "
                "whose attention workspace grows with the context (the plan counts it)",
                "pip install triton-windows" if env.is_windows else "pip install triton",
            )
        elif env.triton_status.startswith("fails"):
            add(
                "error",
                f"Triton kernels do not run on {gpu.name} ({env.triton_status.removeprefix('fails: ')})",
                "use a GPU of compute capability 7.5 or newer, or update triton and the driver; "
                "on the CPU: --profile cpu",
            )
        card_bytes = profile.memory_budget_gib * GIB
        if profile.emulate_vram_gib is None and gpu.total_bytes is not None and gpu.total_bytes < card_bytes * 0.97:
            sizes = (("8gb", 8), ("6gb", 6), ("4gb", 4))
            smaller = next((n for n, g in sizes if gpu.total_bytes >= g * GIB * 0.97), "2gb")
            add(
                "error",
                f"profile {profile.name!r} plans for a {profile.memory_budget_gib:g} GiB card but "
                f"{gpu.name} has {_gib(gpu.total_bytes)}",
                f"pick a smaller profile (e.g. --profile {smaller}) or set {_fitting_budget(gpu.total_bytes)}",
            )
        elif gpu.free_bytes is not None and gpu.total_bytes is not None:
            budget = profile.emulate_vram_gib or profile.memory_budget_gib
            busy = gpu.total_bytes - gpu.free_bytes - (env.cuda_context_bytes or 0)
            if gpu.free_bytes < budget * GIB and busy > OTHER_PROCESSES_SHARE * gpu.total_bytes:
                add(
                    "warning",
                    f"other processes use {_gib(busy)} of {gpu.name}; only {_gib(gpu.free_bytes)} is free "
                    f"for a {budget:g} GiB plan",
                    f"close them (nvidia-smi lists them) or plan for less: {_fitting_budget(gpu.free_bytes)}",
                )
        if gpu.concurrent_managed_access is False and profile.kv_backend in ("um", "auto"):
            where = "Windows" if env.is_windows else "WSL2" if env.is_wsl else "this GPU"
            also = "  and  allow_oversubscription: false" if profile.allow_oversubscription else ""
            add(
                "error" if profile.allow_oversubscription else "warning",
                f"unified memory cannot oversubscribe the card on {where} (no concurrent managed access): "
                "KV pages cannot spill to host RAM through managed memory",
                "kv_backend: pinned" + also,
            )
        if not env.has_cuda_bindings and profile.kv_backend == "um":
            add(
                "warning",
                "cuda-bindings is not installed: the unified-memory KV pool is unavailable",
                "pip install 'lowvram[um]'  (or kv_backend: pinned)",
            )
    available = env.host_available_bytes
    if available is not None and 0 < profile.host_spill_gib and available < profile.host_spill_gib * GIB:
        add(
            "warning",
            f"the profile may spill {profile.host_spill_gib:g} GiB of KV to host RAM but only "
            f"{_gib(available)} is available",
            f"host_spill_gib: {max(0.0, available / GIB * 0.5):.1f}",
        )
    memlock = env.memlock_soft_bytes if env.memlock_known else None
    if wants_cuda and memlock is not None and memlock < MIN_COMFORTABLE_MEMLOCK_BYTES:
        if profile.kv_backend in ("pinned", "auto"):
            add(
                "info",
                f"the locked-memory limit (ulimit -l) is {memlock // 1024} KiB; some container runtimes apply it "
                "to pinned host buffers",
                "if pinned allocations fail: ulimit -l unlimited (docker: --ulimit memlock=-1)",
            )
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(problems, key=lambda p: order[p.severity])
