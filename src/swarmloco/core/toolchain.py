"""Whether ``torch.compile`` can build kernels on this machine.

torch builds a compiled model's or function's kernels with the machine's own compilers:
inductor writes C++ for a CPU's kernels and runs ``$CXX`` (else ``g++``), Triton builds
the launchers of a GPU's kernels with ``$CC`` (else ``gcc``, else ``clang``). A slim
container image or a bare cloud box may have neither, and then every compile fails at its
first call, deep in a training step. :func:`missing_compiler` says so before any work.
"""

from __future__ import annotations

import functools
import os
import shutil


@functools.cache
def missing_compiler(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device_type`` ("cpu" or "cuda")
    here (the compiler it runs is not found), or None when it can."""
    if device_type == "cuda":
        chosen = os.environ.get("CC")
        candidates = [chosen] if chosen else ["gcc", "clang"]
        what = "C compiler ($CC, gcc or clang), which Triton runs to build a GPU's kernels"
    else:
        candidates = [os.environ.get("CXX") or "g++"]
        what = "C++ compiler ($CXX or g++), which inductor runs to build a CPU's kernels"
    if any(shutil.which(c) for c in candidates):
        return None
    return f"no {what}: install one (Debian: apt install g++)"
