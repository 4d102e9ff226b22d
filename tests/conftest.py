import os

import numpy as np
import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def pytest_configure(config):
    # NUMBA_FLASH_SIMCHECK=1 (make test sets it) checks every simulated kernel for shared-memory races, bad indices
    # and divergent barriers, the test kernels' included, from the first launch on.
    if SIM:
        from numba_flash.cuda import simcheck

        simcheck.install_from_env()


def pytest_collection_modifyitems(config, items):
    # Simulator tests need NUMBA_ENABLE_CUDASIM=1 set before numba.cuda is imported, so they run in a process of
    # their own (make test does both); every other test runs without the simulator.
    skip_sim = pytest.mark.skip(reason="CUDA simulator test: run with NUMBA_ENABLE_CUDASIM=1 -m cudasim")
    skip_real = pytest.mark.skip(reason="needs the real CUDA compiler, not the simulator")
    for item in items:
        is_sim = "cudasim" in item.keywords
        if is_sim and not SIM:
            item.add_marker(skip_sim)
        elif SIM and not is_sim:
            item.add_marker(skip_real)


def _seed() -> int:
    """A fresh seed, or NUMBA_FLASH_TEST_SEED's to replay a failure."""
    return int(os.environ.get("NUMBA_FLASH_TEST_SEED", np.random.SeedSequence().entropy % (2**32)))


@pytest.fixture
def rng(request):
    """Fresh random inputs each run; the seed is printed on failure so a failure can be replayed."""
    seed = _seed()
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def module_rng(request):
    """``rng`` for inputs a module's tests share (a module-scoped fixture's); its seed printed the same way, in the
    output of the first test that uses it."""
    seed = _seed()
    print(f"module seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory):
    """One disk cache (NUMBA_FLASH_CACHE_DIR) for every test of the static performance model in a session: each
    (kernel, dtype, head dim, variant, GPUs) is compiled and modelled once (10-25 s each on 2 cores), by whichever
    test asks first; the model is a pure function of the kernel sources, which key the cache."""
    return tmp_path_factory.mktemp("model-cache")
