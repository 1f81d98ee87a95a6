"""remat: a torch.compile backend that fits a training step under a memory budget in GB.

    import torch, remat
    step = torch.compile(model, backend=remat.backend(budget_gb=0.08, dump_dir="remat_dump"))
"""

from .backend import RematBackend, backend
from .compiled_graph import CompiledGraph
from .backend_registry import register as _register
from .errors import BudgetInfeasibleError, RematError
from .measure import PeakMeasurement, measure_peak_bytes
from .metrics import MonitorOptions, StepMetrics, StepMonitor
from .options import BUDGET_ENV_VAR, RematOptions
from .pareto import ParetoCurve, ParetoPoint, pareto
from .passes.plan import Plan
from .sizing import SizeFit, max_size_that_fits

__all__ = [
    "BUDGET_ENV_VAR",
    "BudgetInfeasibleError",
    "CompiledGraph",
    "MonitorOptions",
    "ParetoCurve",
    "ParetoPoint",
    "PeakMeasurement",
    "Plan",
    "RematBackend",
    "RematError",
    "RematOptions",
    "SizeFit",
    "StepMetrics",
    "StepMonitor",
    "backend",
    "max_size_that_fits",
    "measure_peak_bytes",
    "pareto",
]

_register()
