"""Install into the integration venv the declared dependencies that the
imports of the plugin tests actually need.

sglang and vllm are installed with --no-deps: their full dependency sets
pull CUDA-only wheels (flashinfer, sgl-kernel, deep-gemm, ...) and pin two
different torch versions. This loop imports the modules the plugin tests
use, and for each ModuleNotFoundError installs the missing module's package
if (and only if) the metadata of an installed distribution (sglang, vllm
or one of the packages installed for them) declares it; anything else stops
the loop with the name, so the test that needs it says why it skips.
"""
import importlib.metadata as md
import os
import re
import subprocess
import sys

MODULES = sys.argv[1:]
# import name -> distribution name where they differ
ALIASES = {"zmq": "pyzmq", "yaml": "pyyaml", "cpuinfo": "py-cpuinfo", "PIL": "pillow",
           "google": "protobuf", "multipart": "python-multipart",
           "dateutil": "python-dateutil", "cv2": "opencv-python-headless",
           "jwt": "pyjwt", "dotenv": "python-dotenv", "pythonjsonlogger": "python-json-logger",
           "sklearn": "scikit-learn", "attr": "attrs", "grpc": "grpcio",
           "tvm_ffi": "apache-tvm-ffi", "sgl_kernel": "sglang-kernel"}


# imported by sglang but declared only by a dependency of sglang that is not
# installed here (dill: by datasets)
TRANSITIVE = {"dill": "dill"}


def norm(n):
    return re.sub(r"[-_.]+", "-", n).lower()


def constraints():
    path = os.path.join(sys.prefix, "integ-constraints.txt")
    with open(path, "w") as f:
        f.write("torch==%s\n" % md.version("torch"))
    return path


def declared():
    out = {}
    for d in md.distributions():
        for req in d.requires or []:
            if "extra ==" in req:
                continue
            name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
            spec = req.split(";")[0].strip()
            out.setdefault(norm(name), spec)
    return out


def main():
    decl = declared()
    decl.update(TRANSITIVE)
    tried = set()
    for _ in range(80):
        missing = None
        for m in MODULES:
            r = subprocess.run([sys.executable, "-c", "import " + m], capture_output=True,
                               text=True)
            # the last one: earlier ones can be warnings (vllm._C on a CPU host)
            g = re.findall(r"No module named '([^']+)'", r.stderr)
            if r.returncode and g:
                missing = g[-1].split(".")[0]
                break
            if r.returncode:
                print("import %s fails (not a missing module):\n%s" % (m, r.stderr[-1500:]))
                return 1
        if missing is None:
            print("all imports work: %s" % " ".join(MODULES))
            return 0
        dist = norm(ALIASES.get(missing, missing))
        if dist not in decl or dist in tried:
            print("module %r is missing and is not a declared dependency of sglang/vllm "
                  "(or installing it did not help)" % missing)
            return 1
        tried.add(dist)
        spec = decl[dist]
        if dist == "torch" or "cu13" in spec or dist.startswith("nvidia"):
            print("module %r needs %s, a GPU-only dependency: not installed" % (missing, spec))
            return 1
        print("installing %s (for module %s)" % (spec, missing), flush=True)
        # torch stays the version installed first (the frameworks pin two
        # different ones): a pin that needs another torch is dropped
        pip = [sys.executable, "-m", "pip", "install", "-q", "-c", constraints()]
        r = subprocess.run(pip + [spec], stderr=subprocess.DEVNULL)
        if r.returncode:
            r = subprocess.run(pip + [dist], stderr=subprocess.DEVNULL)
        if r.returncode:
            r = subprocess.run(pip + ["--no-deps", spec])
            if r.returncode:
                print("pip could not install %s" % spec)
                return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
