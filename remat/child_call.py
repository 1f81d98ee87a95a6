"""A function called in a fresh Python process on this machine, for a measurement this process cannot make.

On the CPU an allocation is seen only through ``torch.profiler``'s memory events, and only one profiler
can record on a thread: while one records (the user's own, around the step that compiles, as
``docs/design.md`` tells a user to measure a step; or the closed loop's, around a step whose re-plan
compiles inside it), ``measure_calls.calls_peak_bytes`` refuses. The probes of
``simulator/library_scratch.py`` then measured nothing: every library call kept 0 bytes of working
memory, Inductor's check counted none, and a plan was accepted under a peak its step then exceeded (a
drawn ResNet-style CNN under per-block checkpointing, its first step run inside the user's profiler,
measured 2,423,656 B at a budget of 2,284,348 B, 1.061x, on every step; the same budget compiled outside
a profiler measured 2,261,512 B). So they are measured here instead: ``call_in_child(fn, *args)`` pickles
``fn`` (a module-level function, pickled by name) and its arguments, runs ``fn(*args)`` in a child with this
process's torch thread count and oneDNN switch (a library's working memory depends on both), and returns
what it returned (JSON-able). The child's allocations are its own, so they count in no step of this
process either. It costs a Python and torch start-up, about 2.5 s here, and runs only where this process
cannot measure.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

CHILD_TIMEOUT_S = 600.0      # a child that has not answered by then is abandoned (its result: None)
RESULT_MARK = "remat-child-result: "   # the child's answer line on its stdout (anything else printed is not it)
IN_CHILD_ENV = "REMAT_IN_CHILD_CALL"   # set in the child: a child does not start another


def call_in_child(fn: Callable[..., Any], *args: Any, what: str, timeout_s: float = CHILD_TIMEOUT_S) -> Optional[Any]:
    """``fn(*args)`` as a fresh Python process computes it (its result must be JSON-able), or None, with a
    warning naming ``what`` was not measured and why, when ``fn`` or ``args`` cannot be pickled, the
    child fails or takes more than ``timeout_s``, or this process is itself such a child."""
    if os.environ.get(IN_CHILD_ENV):
        return None
    try:
        payload = pickle.dumps({"fn": fn, "args": args, "threads": torch.get_num_threads(),
                                "mkldnn": bool(torch.backends.mkldnn.enabled)})
    except Exception as error:  # noqa: BLE001 - what cannot be sent stays unmeasured, and says so
        log.warning("remat: %s not measured (no measurement can be made in this process now, and the work "
                    "could not be sent to a child process: %s: %s)", what, type(error).__name__, str(error)[:200])
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **{IN_CHILD_ENV: "1"})
    try:
        done = subprocess.run([sys.executable, "-m", __name__], input=payload, capture_output=True, env=env,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("remat: %s not measured: the child process measuring it failed (%s: %s)", what,
                    type(error).__name__, str(error)[:200])
        return None
    answers = [line[len(RESULT_MARK):] for line in done.stdout.decode(errors="replace").splitlines()
               if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or len(answers) != 1:
        log.warning("remat: %s not measured: the child process measuring it exited with %d: %s", what,
                    done.returncode, done.stderr.decode(errors="replace")[-600:])
        return None
    return json.loads(answers[0])


def main() -> int:
    """The child: read the pickled call from stdin, make it, print ``RESULT_MARK`` and its JSON result."""
    request = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(int(request["threads"]))
    torch.backends.mkldnn.enabled = bool(request["mkldnn"])
    print(RESULT_MARK + json.dumps(request["fn"](*request["args"])), flush=True)
    return 0


__all__ = ["CHILD_TIMEOUT_S", "IN_CHILD_ENV", "RESULT_MARK", "call_in_child"]


if __name__ == "__main__":
    sys.exit(main())
