"""Suite-wide setup."""

import atexit
import os
import shutil
import tempfile

# The native step's calibration cache goes to a directory of this run, not the user's cache: every
# test run calibrates for real (as before caching), and the suite writes nothing under $HOME.
if "GEFEN_CACHE_DIR" not in os.environ:
    os.environ["GEFEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="gefen-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GEFEN_CACHE_DIR"], True)

# The Triton kernels (tests/test_triton.py) run in Triton's interpreter on CPU tensors when there
# is no GPU; the variable must be set before Triton is imported (torch imports it with Dynamo).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
