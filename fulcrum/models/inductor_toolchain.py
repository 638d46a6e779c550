"""What the installed torch and this host offer inductor's C++ wrapper: a C++ compiler, and the C shim's
functions for the ops the compiled code leaves to aten. `fulcrum.models.packed.compile_options` asks both
before it chooses the C++ wrapper."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


# The C++ wrapper calls an op that inductor leaves to aten through the C shim's
# `aoti_torch_<device>_<op>`, declared in torch's generated c_shim_<device>.h. torch 2.11's
# c_shim_cuda.h lacks `aoti_torch_cuda__grouped_mm` (2.13's declares it): a mixture of experts'
# compiled layers then failed to build their C++, and keep the Python wrapper on such a torch.
SHIM_HEADERS = Path(torch.__file__).parent / "include/torch/csrc/inductor/aoti_torch/generated"


@functools.cache
def c_shim_declares(op: str, device: str) -> bool:
    """Whether the installed torch's C shim for `device` declares `aoti_torch_<device>_<op>` (aten's
    `op`, e.g. "_grouped_mm"); False, with a warning, when it does not or its header is not found."""
    header = SHIM_HEADERS / f"c_shim_{device}.h"
    try:
        declared = f"aoti_torch_{device}_{op}(" in header.read_text()
    except OSError:
        declared = False
    if not declared:
        logger.warning(
            "torch %s's C shim (%s) has no aoti_torch_%s_%s: compiled layers that call it use inductor's "
            "Python wrapper, slower at small micro-batches (torch 2.13 declares aoti_torch_cuda__grouped_mm)",
            torch.__version__,
            header,
            device,
            op,
        )
    return declared


@functools.cache
def cpp_compiler_found() -> bool:
    """Whether inductor finds a C++ compiler for its C++ wrapper (its own search: `$CXX`, else `g++`).

    Without one the compiled passes keep inductor's Python wrapper, with a warning, rather than fail at
    their first call after the models have loaded (Triton needs only a C compiler, so a machine can run
    the rest and lack this)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # a torch without the helper: inductor decides at the first call
        return True
    try:
        get_cpp_compiler()
    except RuntimeError as err:  # torch._inductor.exc.InvalidCxxCompiler
        logger.warning(
            "no C++ compiler for inductor's C++ wrapper (%s): the compiled training passes use its Python "
            "wrapper, slower at small micro-batches; install g++ (or set CXX) for the faster path",
            err,
        )
        return False
    return True
