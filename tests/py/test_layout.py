"""The layering the tree's folders promise (README, Layout), checked on the
sources: ipc/ (protocol, server, client library) is the bottom of the
daemon and includes nothing from engine/, config/, status/ or daemon/ (of
kernels/ only the host-device contract moe_gpu_abi.h, which includes
nothing of the tree); the
engine never includes the protocol header (the server owns the framing);
moectl links neither libuv's server nor CUDA (client library + libmoedref)."""
import glob
import os
import re
import subprocess

import daemon_util as du

ROOT = du.ROOT
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def headers_of(folder):
    return {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, folder, "*.h"))}


def includes(path):
    with open(path, encoding="utf-8") as f:
        return INCLUDE.findall(f.read())


def sources(folder):
    return sorted(glob.glob(os.path.join(ROOT, folder, "*.[ch]")))


def test_ipc_includes_only_ipc_and_common():
    # and the host-device contract, a leaf header (stddef, stdint): the
    # client library launches the doorbell kernel with its layouts
    allowed = headers_of("ipc") | headers_of("common") | {"moe_gpu_abi.h"}
    with open(os.path.join(ROOT, "kernels", "moe_gpu_abi.h"), encoding="utf-8") as f:
        assert not re.findall(r'^\s*#\s*include\s+"', f.read(), re.M)
    above = headers_of("engine") | headers_of("config") | headers_of("status") | headers_of("daemon")
    assert "server.h" in allowed and "stats.h" in above and "config.h" in above
    bad = [(os.path.relpath(p, ROOT), h) for p in sources("ipc") for h in includes(p)
           if h not in allowed]
    assert not bad, bad
    assert not [b for b in bad if b[1] in above]


def test_engine_does_not_include_the_protocol_header():
    bad = [os.path.relpath(p, ROOT) for p in sources("engine") if "moed_proto.h" in includes(p)]
    assert not bad, bad


def test_moectl_links_no_cuda_and_no_libuv():
    exe = os.path.join(du.BUILD, "moectl")
    out = subprocess.run(["ldd", exe], capture_output=True, text=True, check=True).stdout
    assert "libc.so" in out, out
    for lib in ("libcudart", "libnccl", "libuv"):
        assert lib not in out, (lib, out)
