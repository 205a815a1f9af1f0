"""What a test skipped for a missing framework tells the reader to run (as README's PyTorch
and JAX section does): each installs the CPU build, small and working without a GPU."""

from __future__ import annotations

#: PyTorch's CPU build first (a plain ``pip install torch`` on Linux takes a CUDA build of
#: several GB), then the extra, which it already satisfies.
TORCH = ("pip install torch --index-url https://download.pytorch.org/whl/cpu && "
         "pip install 'clusterwire[torch]'")
#: The extra asks for jax[cpu] already.
JAX = "pip install 'clusterwire[jax]'"
#: By the name a test imports.
BY_LIBRARY = {"torch": TORCH, "jax": JAX}
