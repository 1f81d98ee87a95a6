"""Inductor's generated wrapper modules loaded only for the plan that runs (``remat/_torch_deferred.py``):
a compile the check judges keeps its source at once and builds its kernels only when loaded."""

from __future__ import annotations

import threading

import torch
from torch._inductor.codecache import PyCodeCache
from torch._inductor.compile_fx import compile_fx

from remat._torch_compile import CodeCapture
from remat._torch_deferred import DeferredModule, _local, deferred_loading


def _compiled_with(capture: CodeCapture, scale: float):
    torch._dynamo.reset()

    def f(x):
        return (x.sin() * scale).cos() + x

    def backend(gm, inputs):     # AOTAutograd's cache off: a hit would not call ``inner_compile``
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, inputs, inner_compile=capture.inner_compile)
    return f, torch.compile(f, backend=backend)


def test_a_deferred_compile_keeps_its_source_and_builds_nothing_until_loaded(monkeypatch):
    capture = CodeCapture(defer_loading=True)
    f, compiled = _compiled_with(capture, 3.0)
    x = torch.randn(257)
    loads = []     # per load(): whether it loaded the module (built its kernels) or found it loaded
    original_load = DeferredModule.load
    monkeypatch.setattr(DeferredModule, "load", lambda module: loads.append(module._module is None)
                        or original_load(module))
    out = compiled(x)    # compiles (the source captured, the module deferred), then runs: the call loads it
    (is_backward, code, _), = capture.graphs
    assert not is_backward and "def call(" in code.source_code
    (module,) = capture.deferred
    assert isinstance(module, DeferredModule) and module.__file__.endswith(".py")
    assert loads.count(True) == 1 and module._module is not None
    torch.testing.assert_close(out, f(x))
    assert getattr(module, "no_such_name", None) is None            # what the source does not define is missing
    capture.load()
    assert loads.count(True) == 1                                   # loading again builds nothing


def test_a_module_never_called_is_never_loaded_and_the_patch_is_scoped_to_its_thread():
    original = PyCodeCache.__dict__["load_by_key_path"]
    capture = CodeCapture(defer_loading=True)
    x = torch.randn(33)
    gm = torch.fx.symbolic_trace(lambda x: (x * 7.0).exp() - x)
    with torch._functorch.config.patch(enable_autograd_cache=False):     # compiled, not called
        compiled = compile_fx(gm, [x], inner_compile=capture.inner_compile)
    (module,) = capture.deferred
    assert module._module is None                   # its kernels were never built
    assert PyCodeCache.__dict__["load_by_key_path"] is original      # Inductor's own again after the compile
    out = compiled(x)
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, (x * 7.0).exp() - x)
    assert module._module is not None

    seen_elsewhere: list = []
    with deferred_loading([]):
        assert PyCodeCache.__dict__["load_by_key_path"] is not original
        thread = threading.Thread(target=lambda: seen_elsewhere.append(getattr(_local, "deferred", None)))
        thread.start()
        thread.join()
    assert seen_elsewhere == [None]                 # another thread's loads go to Inductor's function unchanged
    assert PyCodeCache.__dict__["load_by_key_path"] is original


def test_on_a_torch_the_deferral_was_not_checked_against_every_module_loads_as_inductor_loads_it(monkeypatch):
    import remat._torch_deferred as deferred

    assert deferred.deferral_supported()          # the torch the suite runs on (2.13) is verified
    monkeypatch.setattr(deferred, "VERIFIED_TORCH", ())
    capture = CodeCapture(defer_loading=True)
    f, compiled = _compiled_with(capture, 11.0)
    x = torch.randn(19)
    torch.testing.assert_close(compiled(x), f(x))
    assert capture.deferred is None and len(capture.graphs) == 1     # checked as before, nothing deferred
    capture.load()                                                   # nothing to load
