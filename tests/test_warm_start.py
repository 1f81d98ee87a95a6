"""A warm run's first step (issue 16): what a backend imports before it, not inside it.

``torch.compile(fn, backend="inductor")`` imports Inductor's compile path (``torch._inductor.compile_fx``)
when it is called; a backend object is not looked into by ``torch.compile``, so remat imports it when the
backend is made (``_torch_compile.import_compile_path``). Before, the import (0.6-0.8 s on the 2-core VM)
ran inside the first compile, i.e. inside the first training step, on a warm AOTAutograd hit too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import sys
import remat
before = "torch._inductor.compile_fx" in sys.modules
backend = remat.backend(0.03)
print("PROBE", before, "torch._inductor.compile_fx" in sys.modules)
"""


def test_making_a_backend_imports_inductors_compile_path():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line is not None, done.stderr[-2000:]
    _, before, after = line.split()
    # ``import remat`` alone does not import it (a process that only imports remat stays light) ...
    assert before == "False"
    # ... and making a backend does, as torch.compile does for plain Inductor, so the first step does not
    assert after == "True"
