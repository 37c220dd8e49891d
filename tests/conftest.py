"""Suite-wide setup."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# The native step's calibration cache goes to a directory of this run, not the user's cache: every
# test run calibrates for real (as before caching), and the suite writes nothing under $HOME.
if "GEFEN_CACHE_DIR" not in os.environ:
    os.environ["GEFEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="gefen-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GEFEN_CACHE_DIR"], True)

# The Triton kernels (tests/optim/test_triton.py) run in Triton's interpreter on CPU tensors when there
# is no GPU; the variable must be set before Triton is imported (torch imports it with Dynamo).
if "TRITON_INTERPRET" not in os.environ:
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of small tensors: they gain nothing from threads, and on
    a busy machine every parallel region waits for a descheduled peer (test_convert: 1.2 s vs
    7.6 s). Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
