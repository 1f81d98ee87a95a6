"""Diagnostic: replay the buffer allocations and frees of an Inductor CPU wrapper `call()`
(the last one in a TORCH_LOGS=output_code log) and print the live bytes, the peak, and what
is live at the peak with the FX source nodes of each buffer. Inputs are counted from their
`assert_size_stride` shapes (dtype assumed fp32 unless it is known), from entry until `del`.

    python tools/inductor_live.py LOG
"""
import re
import sys
from math import prod

DT = {"torch.float32": 4, "torch.bool": 1, "torch.int64": 8, "torch.float16": 2, "torch.bfloat16": 2,
      "torch.int32": 4, "torch.uint8": 1, "torch.int8": 1}


def replay(body):
    size, refs, names, source = {}, {}, {}, {}
    live, out, last_comment = 0, [], ""

    def bind(name, root):
        names[name] = root
        refs[root] = refs.get(root, 0) + 1

    def unbind(name):
        nonlocal live
        root = names.pop(name, None)
        if root is None:
            return
        refs[root] -= 1
        if refs[root] == 0:
            live -= size.get(root, 0)

    for i, line in enumerate(body):
        s = line.strip()
        if s.startswith("# Topologically Sorted Source Nodes") or s.startswith("# Unsorted Source Nodes"):
            last_comment = s.split("[", 1)[1].split("]", 1)[0] if "[" in s else s
            continue
        m = re.match(r"assert_size_stride\((\w+), \(([^)]*)\)", s)
        if m and m.group(1) not in names:
            shape = [int(x) for x in m.group(2).split(",") if x.strip()]
            size[m.group(1)] = prod(shape) * 4
            bind(m.group(1), m.group(1))
            live += size[m.group(1)]
            source[m.group(1)] = "input"
            continue
        m = re.match(r"(\w+) = empty_strided_cpu\(\(([^)]*)\), \(([^)]*)\), (torch\.\w+)\)", s)
        if m:
            shape = [int(x) for x in m.group(2).split(",") if x.strip()]
            size[m.group(1)] = prod(shape) * DT.get(m.group(4), 4)
            bind(m.group(1), m.group(1))
            live += size[m.group(1)]
            source[m.group(1)] = last_comment
            out.append((i, live, f"+{size[m.group(1)]} {m.group(1)} [{last_comment[:80]}]", dict(refs)))
            continue
        m = re.match(r"(\w+) = (?:reinterpret_tensor\()?(\w+)[,;)]", s)
        if m and m.group(2) in names and m.group(1) != m.group(2):
            bind(m.group(1), names[m.group(2)])
        for d in re.findall(r"del (\w+)", s):
            unbind(d)
        if "del " in s:
            out.append((i, live, s[:60], dict(refs)))
    return out, size, source, names


if __name__ == "__main__":
    text = [re.sub(r"^.*\[__output_code\]\s?", "", t) for t in open(sys.argv[1]).read().splitlines()]
    start = max(i for i, t in enumerate(text) if "def call(self, args)" in t)
    end = next(i for i in range(start, len(text)) if text[i].strip().startswith("return ("))
    events, size, source, names = replay(text[start:end + 1])
    peak = max(events, key=lambda e: e[1])
    for i, live, what, _ in events:
        print(f"{i:5d} {live:10d} {what}{' <== PEAK' if (i, live) == (peak[0], peak[1]) else ''}")
    print("\nlive at peak:")
    for root, count in sorted(peak[3].items(), key=lambda kv: -size.get(kv[0], 0)):
        if count > 0:
            print(f"  {root:10s} {size.get(root, 0):9d} {source.get(root, '')[:100]}")
