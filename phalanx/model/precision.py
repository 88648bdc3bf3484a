"""Mixed precision and compilation, checked against the hardware.

`train.precision` picks an autocast dtype (fp32 = no autocast); fp16 adds a dynamic loss scaler whose
state goes into the checkpoint. `auto` is bf16 only where the device runs it natively, as torch reports
it (CUDA: compute capability >= 8.0; CPU: AVX512-BF16 or AMX-BF16 instructions): measured on a CPU with
AMX, bf16 autocast ran ~1.45x faster than fp32 (losses within ~1e-4), while emulated bf16 can be slower
than fp32. The same check runs in the launcher (before workers start, so a bad choice fails fast with
exit code 2) and in each worker (which reports what it picked).
"""
from __future__ import annotations

import contextlib
import os
import shutil

import torch

from phalanx.core.config import ConfigError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cpu_has(*features: str) -> bool:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return any(caps.get(f, False) for f in features)


def native(dtype: torch.dtype, device_type: str) -> bool:
    """Does this device compute in `dtype` natively (not emulated through fp32)?"""
    if device_type == "cuda":
        if dtype == torch.bfloat16:
            try:
                return torch.cuda.is_bf16_supported(including_emulation=False)
            except TypeError:  # torch < 2.5 has no emulation flag and reports native support only
                return torch.cuda.is_bf16_supported()
        return True  # fp16 tensor cores since Volta; older GPUs still run fp16 natively
    if dtype == torch.bfloat16:
        return _cpu_has("avx512_bf16", "amx_bf16")
    return _cpu_has("avx512_fp16", "amx_fp16")


def check_precision(requested: str, device_type: str) -> tuple[torch.dtype | None, list[str]]:
    """(autocast dtype or None for fp32, warnings). Raises ConfigError where the choice cannot work."""
    if requested == "auto":
        return (torch.bfloat16 if native(torch.bfloat16, device_type) else None), []
    dtype = DTYPES[requested]
    if dtype is None or native(dtype, device_type):
        return dtype, []
    if device_type == "cuda":  # only bf16 can get here
        name = torch.cuda.get_device_name()
        raise ConfigError(f"config key 'train.precision': bf16 is not native on {name} (compute capability "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability()))} < 8.0); use fp16 or auto")
    why = {"bf16": "AVX512-BF16/AMX-BF16", "fp16": "AVX512-FP16/AMX-FP16"}[requested]
    slower = "several times slower than fp32" if requested == "fp16" else "slower than fp32"
    return dtype, [f"config key 'train.precision': {requested} on this CPU is emulated (torch reports no "
                   f"{why} instructions) and typically {slower}; use auto or fp32"]


def name(dtype: torch.dtype | None) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def describe(requested: str, dtype: torch.dtype | None) -> str:
    """What the start-up line says, e.g. 'bf16 (auto: native bf16 on cpu)'."""
    if requested != "auto":
        return name(dtype)
    return f"{name(dtype)} (auto: {'native bf16' if dtype else 'no native bf16, so fp32'})"


def set_tf32(enabled: bool, device_type: str) -> bool | None:
    """`train.tf32` on CUDA: fp32 matrix multiplies (cuBLAS) and convolutions (cuDNN) on TF32 tensor cores,
    or both in full fp32. Set through the `allow_tf32` flags: torch >= 2.9 also has `fp32_precision`, but a
    write through the new flags makes a later read of the old ones (which libraries still do) raise.
    The CPU is left alone (oneDNN has its own setting), so its numbers never change. Returns the setting
    applied, None on CPU."""
    if device_type != "cuda":
        return None
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


def autocast_factory(device: torch.device, dtype: torch.dtype | None):
    """A zero-argument callable returning the autocast context for forward passes."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def fsdp_policy(dtype: torch.dtype | None):
    """FSDP2's mixed precision for a 16-bit `train.precision`: parameters all-gathered and computed in 16 bit
    (half the bytes of each all-gather), gradients reduced in fp32 into fp32 gradient shards, so the master
    weights and the optimizer state stay fp32. Autocast still runs around the forward (the ops it keeps in
    fp32, such as softmax and norms, stay there). fp32: no casts."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def check_offload(cpu_offload: bool, device_type: str) -> None:
    """`train.cpu_offload` moves FSDP2's shards from GPU memory to the host: without a GPU there is nothing
    to offload from."""
    if cpu_offload and device_type != "cuda":
        raise ConfigError("config key 'train.cpu_offload': offloads GPU memory to the host, and this run has no GPU "
                          "(the CPU backend); set train.cpu_offload=false")


def make_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16 (disabled otherwise: its state_dict() is then {}). Its state is
    plain floats/ints, so it is stored in the checkpoint's meta.json. Under FSDP2 the overflow flag
    of sharded gradients is max-reduced over ranks by DTensor, so all ranks skip the same steps."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def check_compile(device_type: str) -> None:
    """torch.compile generates code that a compiler on PATH must build, so fail before start-up without
    one: on CPU inductor writes C++ (g++/clang++, or $CXX); on CUDA, Triton compiles its kernel launcher
    in C at the first step (cc/gcc/clang, or $CC)."""
    if device_type == "cpu":
        from torch._inductor import config as inductor_config  # lazy: inductor loads only with train.compile

        configured = inductor_config.cpp.cxx  # e.g. (None, "g++"), honouring $CXX
        names = [c for c in (configured if isinstance(configured, tuple) else (configured,)) if c]
        what = "a C++ compiler (g++ or clang++)"
    else:
        names = [c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c]
        what = "a C compiler (gcc, clang or $CC; Triton builds its kernel launcher with it)"
    if not any(shutil.which(c) for c in names):
        raise ConfigError(f"config key 'train.compile': torch.compile on {device_type.upper()} needs {what} on "
                          f"PATH; install one or set train.compile=false")


def base_dtype(model_cfg, strategy: str, world_size: int, amp_dtype: torch.dtype | None,
               saved_dtype=lambda: None) -> torch.dtype | None:
    """`model.base_dtype` -> the dtype a LoRA run stores its frozen base in (None: fp32, as every weight
    of a full fine-tuning). `saved_dtype()` is the pretrained checkpoint's dtype (asked only for auto).

    Under FSDP2 (sharded) a 16-bit base works with any compute dtype: each block is gathered in
    train.precision's dtype (fp32: cast up one block at a time). Without sharding (ddp, one process) a
    16-bit weight meets the fp32 activations of an fp32 run in every matmul, so there it needs 16-bit
    autocast: auto then keeps fp32, and an explicit bf16/fp16 base is exit 2 naming train.precision=bf16
    (casting each module's weights up when used would hold an fp32 copy of every weight the backward
    needs: the memory a 16-bit base saves)."""
    choice = model_cfg.base_dtype
    if not model_cfg.lora.r:  # nothing frozen (config validation refuses a 16-bit choice)
        return None
    sharded = strategy == "fsdp" and world_size > 1
    if choice == "auto":
        saved = saved_dtype()
        if saved not in (torch.bfloat16, torch.float16):
            return None
        return saved if sharded or amp_dtype is not None else None
    dtype = DTYPES[choice]
    if dtype is not None and not sharded and amp_dtype is None:
        raise ConfigError(f"config key 'model.base_dtype': a {choice} base under "
                          f"{'ddp' if world_size > 1 else 'one process'} needs 16-bit compute (its weights would "
                          f"meet fp32 activations): set train.precision=bf16 (or fp16), or model.base_dtype=fp32, "
                          f"or train.strategy=fsdp on several processes")
    return dtype
