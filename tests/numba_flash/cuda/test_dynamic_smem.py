"""The opt-in to more than 48 KiB of dynamic shared memory (numba_flash/cuda/host/smem.py), against a fake driver: what
it sets, on which function and device, and when it declines so that the 48 KiB config runs instead."""

from types import SimpleNamespace

import pytest

from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT
from numba_flash.cuda.host.smem import DEVICE_OPTIN, FUNC_ATTRIBUTE, allow_dynamic_smem, device_optin_limit

ATTR = object()   # stands for the enum member; the call must pass this very object


class FakeDriver:
    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def cuKernelSetAttribute(self, attr, value, handle, device_id):
        if self.fail:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")
        self.calls.append((attr, value, handle, device_id))


def fake_binding(with_attr: bool = True):
    enum = SimpleNamespace(**({FUNC_ATTRIBUTE: ATTR} if with_attr else {}))
    return SimpleNamespace(CUfunction_attribute=enum)


def fake_cufunc(optin: int | None = 227 * 1024, device_id: int = 3):
    device = SimpleNamespace(id=device_id, **({DEVICE_OPTIN: optin} if optin is not None else {}))
    return SimpleNamespace(handle="kernel-handle", device=device)


def test_sets_the_size_on_the_functions_handle_for_its_device():
    drv = FakeDriver()
    assert allow_dynamic_smem(fake_cufunc(), 100_000, drv, fake_binding())
    assert drv.calls == [(ATTR, 100_000, "kernel-handle", 3)]


def test_up_to_48_kib_needs_no_attribute():
    drv = FakeDriver()
    assert allow_dynamic_smem(fake_cufunc(), STATIC_SMEM_LIMIT, drv, fake_binding())
    assert drv.calls == []


@pytest.mark.parametrize("why", ["device limit lower", "no attribute in the bindings", "driver refuses",
                                 "device cannot say"])
def test_declines_and_sets_nothing(why):
    drv = FakeDriver(fail=why == "driver refuses")
    cufunc = fake_cufunc(optin={"device limit lower": 99 * 1024, "device cannot say": None}.get(why, 227 * 1024))
    binding = fake_binding(with_attr=why != "no attribute in the bindings")
    assert not allow_dynamic_smem(cufunc, 160 * 1024, drv, binding)
    assert drv.calls == []


def test_device_limit_reads_the_optin_attribute():
    assert device_optin_limit(SimpleNamespace(**{DEVICE_OPTIN: 232448})) == 232448
    assert device_optin_limit(SimpleNamespace()) == STATIC_SMEM_LIMIT
    assert device_optin_limit(SimpleNamespace(**{DEVICE_OPTIN: 1024})) == STATIC_SMEM_LIMIT


def test_the_real_bindings_have_the_attributes_it_names():
    """Catches a rename in cuda-bindings, which would silently turn every opt-in into the 48 KiB fallback."""
    from cuda.bindings import driver as binding

    assert hasattr(binding.CUfunction_attribute, FUNC_ATTRIBUTE)
    assert hasattr(binding.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + DEVICE_OPTIN)
    from numba.cuda.cudadrv.driver import driver

    assert hasattr(type(driver), "__getattr__")   # the wrapper resolves cuKernelSetAttribute on use


class FakeDispatcher:
    """A numba-cuda dispatcher as smem.launch uses it: ``typeof_pyval``, ``compile`` (the overload for those
    types), ``[config](*args)``."""

    def __init__(self, events):
        self.events, self.overloads = events, {}

    def typeof_pyval(self, value):
        return f"type of {value}"

    def compile(self, argtypes):
        cufunc = fake_cufunc()
        self.overloads[argtypes] = SimpleNamespace(_codelibrary=SimpleNamespace(get_cufunc=lambda: cufunc))
        self.events.append(("compile", argtypes))
        return self.overloads[argtypes]

    def __getitem__(self, launch_config):
        # bool(self.overloads): whether the overload (the one whose function got the attribute) exists at launch
        return lambda *args: self.events.append(("launch", bool(self.overloads),
                                                 launch_config, args))


@pytest.mark.parametrize("allowed", [True, False])
def test_launch_opts_in_the_function_it_then_launches(monkeypatch, allowed):
    from numba_flash.cuda.host import smem

    events = []
    monkeypatch.setattr(smem, "allow_dynamic_smem",
                        lambda cufunc, nbytes: events.append(("allow", cufunc.handle, nbytes)) or allowed)
    kernel = FakeDispatcher(events)
    assert smem.launch(kernel, (3, 2, 1), 128, 0, 100_000, ("q", 7)) is allowed
    want = [("compile", ("type of q", "type of 7")), ("allow", "kernel-handle", 100_000)]
    # The dispatcher whose overload for these types got the attribute runs, with the bytes as 4th element.
    want += [("launch", True, ((3, 2, 1), 128, 0, 100_000), ("q", 7))] if allowed else []
    assert events == want
    # Within 48 KiB nothing is compiled ahead or set: the dispatcher just launches.
    events.clear()
    kernel = FakeDispatcher(events)
    assert smem.launch(kernel, (1, 1, 1), 64, 0, 0, ("q",))
    assert events == [("launch", False, ((1, 1, 1), 64, 0), ("q",))]
