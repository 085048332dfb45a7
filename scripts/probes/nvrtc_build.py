"""The kernel text compile.rs hands NVRTC, and an NVRTC compile of it, for the probes that read
what the compiler makes of a kernel file without a GPU (ptx_counts.py, early_loads.py).

NVRTC comes from `pip install --target /tmp/nvrtc 'nvidia-cuda-nvrtc==13.0.*'` (the device
machine's version); put its lib folder on LD_LIBRARY_PATH, or NVRTC_LIB at its libnvrtc.so.13.
"""
import ctypes
import os
import sys

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "crates",
                       "moerun-cuda", "kernels")


def source(path, bf16_kv=False):
    """File `path`'s text as compile.rs builds it: the bf16-KV define for the `_kvbf16` builds,
    common.cuh, attention_common.cuh for the attention files, then the file (the preludes from
    the file's own folder, so another tree's kernels can be compared)."""
    folder = os.path.dirname(path)
    text = "#define MOERUN_KV_BF16\n" if bf16_kv else ""
    text += open(os.path.join(folder, "common.cuh")).read() + "\n"
    if os.path.basename(path).startswith("attention"):
        text += open(os.path.join(folder, "attention_common.cuh")).read() + "\n"
    return text + open(path).read()


def compile_source(text, arch):
    """PTX text for a virtual `arch` (compute_90), cubin bytes for a real one (sm_90)."""
    lib = ctypes.CDLL(os.environ.get("NVRTC_LIB", "libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"k.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    failed = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    if failed:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode())
    if arch.startswith("compute_"):
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetPTX(prog, buf)
        return buf.value.decode()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    return buf.raw
