"""What inductor's precompiled header costs and buys the C++ wrapper of CUDA graphs (`cpp_cache_precompile_headers`).

    python bench/tools/precompiled_header.py --cuda-home /usr/local/cuda    # a CPU with the CUDA headers

Three figures, each in a new process run by this script, on inductor's own builders with the flags a CUDA
graph's wrapper gets (the vector-instruction check off, as fulcrum's CUDA compile options set it):
- `build`: the header's first use on a machine, which preprocesses `cpp_wrapper/cuda.h`, hashes the output
  and compiles the precompiled header (kept in inductor's default cache folder, `precompiled_headers/`,
  whatever TORCHINDUCTOR_CACHE_DIR says);
- `check`: every later process's first use of it (preprocess and hash, then the header is found);
- `wrapper`: compiling one source that includes the wrapper's header (no graph: the header's share of a
  wrapper's compile), with and without the precompiled header; compile only, so no libtorch_cuda is needed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
import torch.utils.cpp_extension as cpp_extension
cpp_extension.CUDA_HOME = sys.argv[1]  # a CPU build of torch looks for no CUDA toolkit by itself
from torch._inductor import config
from torch._inductor.codecache import _get_cpp_wrapper_header, _precompile_header, pick_vec_isa
from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

config.cpp.vec_isa_ok = False
command = dict(include_pytorch=True, shared=True, device_type="cuda", extra_flags=(), use_relative_path=False,
               vec_isa=pick_vec_isa())
header, work = _get_cpp_wrapper_header("cuda"), sys.argv[2]
options = CppTorchDeviceOptions(compile_only=True, min_optimize=True, **command)
line = CppBuilder(name="o", sources="i", BuildOption=options).get_command_line()
started = time.perf_counter()
pch = _precompile_header(header, line, min_optimize=True, **command)
figures = {"header_s": time.perf_counter() - started}
source = f"{work}/wrapper.cpp"
with open(source, "w") as f:
    f.write(f'#include <{header}>\\nextern "C" int entry(int x) {{ return x + 1; }}\\n')
for name, precompiled in (("without", None), ("with", pch)):
    options = CppTorchDeviceOptions(compile_only=True, min_optimize=True, **command)
    options.precompiled_header = precompiled
    builder = CppBuilder(name=f"wrapper_{name}", sources=source, BuildOption=options, output_dir=work)
    started = time.perf_counter()
    builder.build()
    figures[f"wrapper_{name}_s"] = time.perf_counter() - started
print(json.dumps(figures))
"""


def run_child(cuda_home: str, work: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, cuda_home, work], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cuda-home", default="/usr/local/cuda", help="the CUDA toolkit's folder (headers)")
    args = parser.parse_args(argv)
    from torch._inductor.codecache import _HEADER_DIR

    with tempfile.TemporaryDirectory() as work:
        fresh = not any(Path(_HEADER_DIR).glob("*.gch")) if Path(_HEADER_DIR).exists() else True
        first, second = run_child(args.cuda_home, work), run_child(args.cuda_home, work)
    summary = {
        "build_s" if fresh else "check_s (the header was already built)": round(first["header_s"], 2),
        "check_s": round(second["header_s"], 2),
        "wrapper_with_s": round(second["wrapper_with_s"], 2),
        "wrapper_without_s": round(second["wrapper_without_s"], 2),
        "header_dir": _HEADER_DIR,
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
