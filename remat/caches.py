"""remat's caches from the command line (docs/caches.md)::

    python -m remat.caches where      # the directories: remat's cache, its compile cache, the CPU profile
    python -m remat.caches clear      # delete the plan cache, the records restored on AOTAutograd hits, the settled steps,
                                      # the measured working memory of library calls
    python -m remat.caches measure    # measure this machine's CPU profile and cache it (replaces the default)
    python -m remat.caches show       # the CPU profile compiles use now, and where it comes from

Inductor's own caches (AOTAutograd's among them) are under ``TORCHINDUCTOR_CACHE_DIR``; feedback
corrections are cleared by ``remat.feedback_store.clear_corrections()``.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from .cost_model.hardware import cache_dir, get_profile, measure_cpu_profile, profile_cache_path
from .plan_cache import clear_compile_cache, compile_cache_dir


def main(argv: Optional[list[str]] = None) -> int:
    """Run one command (see the module docstring); 2 and a usage line for anything else."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["where"]:
        print(f"remat cache:   {cache_dir()}\ncompile cache: {compile_cache_dir()}\n"
              f"CPU profile:   {profile_cache_path(torch.device('cpu'))}")
    elif args == ["clear"]:
        print(f"removed {clear_compile_cache()} entries from {compile_cache_dir()}")
        scratch = cache_dir() / "scratch"
        removed = [path.unlink() for path in scratch.glob("*.json")] if scratch.is_dir() else []
        print(f"removed {len(removed)} measured library-call scratch tables from {scratch}")
    elif args == ["measure"]:
        profile = measure_cpu_profile()
        print(f"measured and cached in {profile_cache_path(torch.device('cpu'))}: {profile.source}")
    elif args == ["show"]:
        print(get_profile("cpu"))
    else:
        print("usage: python -m remat.caches {where|clear|measure|show}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
