# Sourced by the scripts that run on the GPU machine: the libraries the build
# carried (.device/lib) and the machine's libnccl.so.2 (CUDA's lib64 or the pip
# wheel) on LD_LIBRARY_PATH.
export LD_LIBRARY_PATH="$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nccl=$(ls /usr/local/cuda/lib64/libnccl.so.2 2>/dev/null ||
       python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null ||
       true)
[ -n "$nccl" ] && [ -e "$nccl" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$nccl")"
