"""Reading the text of the wrapper Inductor generates (``CompiledFxGraph.source_code``): the statements of
its ``call``, the library calls it makes, and the patterns of its allocations, views, frees and size
assertions. Pure text, no torch: ``inductor_check.replay_wrapper`` walks these statements.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

ALLOC = re.compile(r"^(\w+) = empty_strided_(\w+)\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)")
VIEW = re.compile(r"^(\w+) = (?:reinterpret_tensor\()?(\w+)(?:$|,|\))")
ASSIGN = re.compile(r"^(\w+) = (.+)$")
ASSERT_SIZE = re.compile(r"^assert_size_stride\((\w+), \(([^)]*)\), \(([^)]*)\)(?:, '(?:torch\.ops\.)?([\w.]+)')?")
DEL = re.compile(r"^del ([\w, ]+)$")
ELEMENT = re.compile(r"^(\w+)\[\d+\]$")
ELEMENT_OF = re.compile(r"^\w+ = \w+\[\d+\]$")
RENAME = re.compile(r"^\w+ = \w+$")     # another name for a value (``buf3 = buf2``: a fallback kernel's result)
LIBRARY_RESULT = re.compile(r"^\w+ = (?:torch\.ops\.|extern_kernels\.|aten\.)")
LIBRARY_CALL = re.compile(r"\b(?:extern_kernels|torch\.ops\.\w+|aten)\.(\w+)\(|\b(?:torch\.ops\.\w+|aten)\.(\w+)\.\w+\(")


def call_body(source_code: str) -> Optional[list[str]]:
    """The statements of the wrapper's ``call`` (stripped, comments dropped, ``;`` split), or
    None when the module has no single ``call`` whose allocations it holds itself (graph
    partitions run their buffers in other functions)."""
    lines = source_code.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"^\s*def call\((self, )?args\):", line)), None)
    if start is None:
        return None
    indent = len(lines[start]) - len(lines[start].lstrip())
    body: list[str] = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        code = line.split("#", 1)[0].strip()
        if "self.partitions[" in code or "partitions[" in code:
            return None
        body.extend(part.strip() for part in code.split(";") if part.strip())
    return body


def library_calls(source_code: str) -> frozenset[str]:
    """The library calls a generated wrapper's ``call`` makes, by op name (``extern_kernels.addmm(`` ->
    "addmm", ``torch.ops.aten.convolution_backward.default(`` -> "convolution_backward"); empty when the
    code has no readable ``call``. Inductor's own kernels are not library calls: their buffers are all
    in the code. (``replay_wrapper`` reports the same set for the code it replays.)"""
    return library_calls_in(call_body(source_code) or [])


def library_calls_in(body: Sequence[str]) -> frozenset[str]:
    return frozenset(a or b for statement in body for a, b in LIBRARY_CALL.findall(statement))


def ints_or_none(text: str) -> Optional[list[int]]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        return None     # a symbolic size


def split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "(["
        depth -= char in ")]"
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def returned_values(statement: str) -> list[str]:
    inner = statement[len("return"):].strip()
    if inner[:1] in "([" and inner[-1:] in ")]":
        inner = inner[1:-1]
    return split_top_level(inner)


def elements_at_their_call(body: Sequence[str]) -> list[str]:
    """``body`` with each element of a library call's tuple (``bufK = bufN[i]`` and the
    ``assert_size_stride`` that sizes ``bufK``) moved to right after the call: the call allocated every
    element, but the wrapper takes each out of the tuple just before its first use, later kernels in
    between (SDPA-backward's grad q, k and v taken one by one between the matmuls that read them: a
    replay in statement order counted two of them 64 KiB late, under the step's peak on corpus net
    rand-1255, -4.8%). Buffer names are bound once in a ``call``, so a tuple's elements are the
    statements that name it."""
    elements: dict[str, list[int]] = {}    # a tuple's name -> the statements taking its elements out
    sized: dict[str, int] = {}             # a name -> its first assert_size_stride
    for index, statement in enumerate(body):
        if ELEMENT_OF.match(statement):
            elements.setdefault(statement.split(" = ", 1)[1].split("[", 1)[0], []).append(index)
        elif (size := ASSERT_SIZE.match(statement)) and size.group(1) not in sized:
            sized[size.group(1)] = index
    after: dict[int, list[int]] = {}       # a library call -> the statements moved right after it
    moved: set[int] = set()
    for index, statement in enumerate(body):
        if not LIBRARY_RESULT.match(statement):
            continue
        group: set[int] = set()
        for element in elements.get(statement.split(" = ", 1)[0], ()):
            if element > index:
                group.add(element)
                assert_index = sized.get(body[element].split(" = ", 1)[0], -1)
                if assert_index > element:
                    group.add(assert_index)
        after[index] = sorted(group - moved)
        moved.update(group)
    out: list[str] = []
    for index, statement in enumerate(body):
        if index not in moved:
            out.append(statement)
            out.extend(body[i] for i in after.get(index, ()))
    return out


def library_outputs_before_frees(body: Sequence[str]) -> list[str]:
    """``body`` with the ``del``s that follow a library call moved after the statements that size its
    outputs (``bufN = bufM[i]``, ``assert_size_stride``, each element first moved to the call,
    ``elements_at_their_call``): the call allocates its outputs while its
    inputs are alive, but the wrapper frees the inputs before it asserts the outputs' sizes, and a
    replay in statement order would count the two apart (on the zoo Llama, SDPA-backward's q, k, v,
    output and logsumexp: 1.06 MB under the step's peak). A rename of the result (``buf3 = buf2``, then
    the assert on ``buf3``: a fallback kernel's output) sizes it too."""
    ordered: list[str] = []
    held: list[str] = []
    after_call = False
    for statement in elements_at_their_call(body):
        if after_call and DEL.match(statement):
            held.append(statement)
            continue
        if after_call and (ASSERT_SIZE.match(statement) or ELEMENT_OF.match(statement) or RENAME.match(statement)
                           or statement.startswith("assert_alignment(")):
            ordered.append(statement)
            continue
        ordered.extend(held)
        held.clear()
        ordered.append(statement)
        after_call = bool(LIBRARY_RESULT.match(statement))
    return ordered + held


__all__ = ["ALLOC", "ASSERT_SIZE", "ASSIGN", "DEL", "ELEMENT", "ELEMENT_OF", "LIBRARY_CALL", "LIBRARY_RESULT", "RENAME", "VIEW",
           "call_body", "elements_at_their_call", "ints_or_none", "library_calls", "library_calls_in", "library_outputs_before_frees",
           "returned_values", "split_top_level"]
