"""The kernel profile of a decode step for evals.tpot: which GPU kernels run per step and each one's share of the
step's critical path (torch.profiler / CUPTI)."""

from __future__ import annotations

import torch

from .common import table


def profile_spans(fn) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of each GPU kernel executed while fn() runs, in start order (torch.profiler / CUPTI;
    kernels inside CUDA graphs are recorded one by one too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))
    ]
    return sorted(spans, key=lambda s: s[1])


def by_place(spans: list[tuple[str, float, float]], skip: dict[str, int], places: dict[str, int]) -> list:
    """The spans with each run of a kernel in `places` (name -> runs per layer) renamed "name #i", i its place
    among that kernel's runs in a layer (1 = first), counting from its run after the first skip[name] (the
    prefill's)."""
    seen: dict[str, int] = {}
    out = []
    for name, start, end in spans:
        if name in places:
            k = seen.get(name, 0)
            seen[name] = k + 1
            if k >= skip.get(name, 0):
                name = f"{name} #{(k - skip.get(name, 0)) % places[name] + 1}"
        out.append((name, start, end))
    return out


def kernel_shares(spans: list[tuple[str, float, float]]) -> dict[str, list]:
    """(name, start us, end us) of each kernel run -> by name: [launches, total us, critical us].

    Under programmatic dependent launch a kernel starts while the one before it runs (its blocks wait on-chip), so
    durations overlap and add up to more than the step. A kernel's critical time is the part of its run that no
    kernel which ended before it covers. In a chain of dependent kernels that is the time from the previous kernel's
    end to its own, its share of the critical path; the shares add up to the time any kernel ran (gaps with none
    running are in no share)."""
    shares: dict[str, list] = {}
    covered: list[list[float]] = []  # disjoint [start, end] of the runs so far, in order
    for name, start, end in sorted(spans, key=lambda s: s[2]):
        # Every interval so far ends by `end`, so only the trailing ones that reach past `start` overlap this run.
        overlap, merged_start = 0.0, start
        while covered and covered[-1][1] > start:
            c_start, c_end = covered.pop()
            overlap += c_end - max(c_start, start)
            merged_start = min(merged_start, c_start)
        covered.append([merged_start, end])
        entry = shares.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += end - start
        entry[2] += end - start - overlap
    return shares


def short_kernel_name(name: str, limit: int = 100) -> str:
    """A kernel's name without "void", namespaces of ours and the parameter list; template arguments kept (they
    tell our launches apart)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").replace("patcher::", "")
    depth = 0
    for i, c in enumerate(name):  # the parameter list starts at the first "(" outside template brackets
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0:
            name = name[:i]
            break
    return name if len(name) <= limit else name[: limit - 3] + "..."


def short_place_name(name: str) -> str:
    """short_kernel_name, keeping by_place's " #i"."""
    base, mark, place = name.rpartition(" #")
    return short_kernel_name(base) + mark + place if mark and place.isdigit() else short_kernel_name(name)


def ranked(rows: dict, limit: int) -> list:
    """The `limit` rows (name -> [launches, us, critical us]) of most critical time, as the kernel tables list them."""
    order = sorted(rows.items(), key=lambda kv: -kv[1][2])[:limit]
    return [
        {"kernel": short_place_name(k), "launches": c, "us": us, "critical_us": cr, "critical_us_each": cr / c}
        for k, (c, us, cr) in order
    ]


def repeated_per_layer(rows: dict, layers: int) -> dict[str, int]:
    """name -> runs per layer, for each kernel of `rows` run several times in each of the `layers` layers."""
    return {n: round(r[0] / layers) for n, r in rows.items() if r[0] > layers and r[0] % layers == 0}


def step_profile(generate, layers: int, steps: int = 8, top: int = 12) -> dict:
    """Kernels per decode step and where the step's GPU time goes: profile (1 token) and (steps + 1 tokens) and
    take the difference per step. Ranked by critical time (kernel_shares), which adds up to the time a kernel ran; the
    summed durations overlap under programmatic dependent launch. A kernel that runs several times in each of the
    `layers` layers (the int4 linears) is also split by its place in the layer ("kernel_places")."""
    one_spans, many_spans = profile_spans(lambda: generate(1)), profile_spans(lambda: generate(steps + 1))

    def per_step(one: dict, many: dict) -> dict:
        rows = {}
        for name, (count, us, critical) in many.items():
            c0, us0, critical0 = one.get(name, (0, 0.0, 0.0))
            if count > c0:
                rows[name] = [(count - c0) / steps, (us - us0) / steps, (critical - critical0) / steps]
        return rows

    one = kernel_shares(one_spans)
    rows = per_step(one, kernel_shares(many_spans))
    places = repeated_per_layer(rows, layers)
    skip = {n: one[n][0] if n in one else 0 for n in places}
    by_layer = per_step(one, kernel_shares(by_place(many_spans, skip, places)))
    return {
        "kernels_per_step": sum(c for c, _, _ in rows.values()),
        "kernel_us_per_step": sum(us for _, us, _ in rows.values()),
        "critical_us_per_step": sum(critical for _, _, critical in rows.values()),
        "top_kernels": ranked(rows, top),
        "kernel_places": ranked({k: v for k, v in by_layer.items() if "#" in k}, 4 * top),
    }


KERNEL_COLUMNS = [
    ("kernel", "kernel", ""),
    ("launches", "launches/step", ".1f"),
    ("critical_us", "critical us/step", ".1f"),
    ("critical_us_each", "critical us/launch", ".2f"),
    ("us", "duration us/step", ".1f"),
]


def prefill_shares(spans: list[tuple[str, float, float]], layers: int, top: int = 12) -> dict:
    """Where one prefill forward's GPU time goes, from its kernels' spans: the kernels ranked by critical time
    (kernel_shares), and those that run several times a layer (the GEMMs, a GGUF linear's dequantization) split by
    their place in it, as step_profile splits a decode step's."""
    rows = kernel_shares(spans)
    places = repeated_per_layer(rows, layers)
    by_layer = kernel_shares(by_place(spans, {}, places))
    critical = sum(c for _, _, c in rows.values())
    span = max(end for _, _, end in spans) - min(start for _, start, _ in spans)
    return {
        "prefill_kernels": sum(c for c, _, _ in rows.values()),
        "prefill_kernel_us": sum(us for _, us, _ in rows.values()),
        "prefill_critical_us": critical,
        "prefill_span_us": span,
        "prefill_top_kernels": ranked(rows, top),
        "prefill_kernel_places": ranked({k: v for k, v in by_layer.items() if "#" in k}, 4 * top),
        "prefill_idle": idle_gaps(spans, top),
    }


def idle_gaps(spans: list[tuple[str, float, float]], top: int = 12) -> list[dict]:
    """Where the GPU ran no kernel between the first kernel's start and the last one's end (waiting on the CPU, or
    on a copy), by the kernels that end and begin each gap: the `top` pairs of most idle time."""
    pairs: dict[tuple[str, str], list] = {}
    last_name, last_end = None, None
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        if last_end is not None and start > last_end:
            entry = pairs.setdefault((last_name, name), [0, 0.0])
            entry[0] += 1
            entry[1] += start - last_end
        if last_end is None or end > last_end:
            last_name, last_end = name, end
    order = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]
    return [
        {"after": short_kernel_name(a, 50), "before": short_kernel_name(b, 50), "gaps": n, "idle_us": us}
        for (a, b), (n, us) in order
    ]


def prefill_profile(forward, layers: int, top: int = 12) -> dict:
    """prefill_shares of one call of `forward` (a prefill). The caller has run it before (evals.tpot's prefill_ms:
    kernel builds and autotuning are done)."""
    return prefill_shares(profile_spans(forward), layers, top)


# The same columns for a prefill: counts and times of one forward.
PREFILL_KERNEL_COLUMNS = [(key, header.removesuffix("/step"), fmt) for key, header, fmt in KERNEL_COLUMNS]
IDLE_COLUMNS = [
    ("after", "after", ""),
    ("before", "before", ""),
    ("gaps", "gaps", "d"),
    ("idle_us", "idle us", ".1f"),
]


def kernel_tables(row: dict, title: str) -> list[str]:
    """The text blocks --kernel-table prints for a measured row (evals.tpot): the decode step's kernels, overall and
    by their place in a layer, then the prefill's, and the prefill's idle GPU time; those the row holds."""
    blocks = []

    def tables(head: str, kind: str, columns: list, keys: tuple) -> None:
        top, places, *idle = keys
        blocks.extend([head, table(row[top], columns)])
        if row.get(places):
            head = f"\n{kind} that run several times a layer, by their place in it (#1 first):"
            blocks.extend([head, table(row[places], columns)])
        if idle and row.get(idle[0]):
            head = "\nthe prefill's idle GPU time, by the kernels before and after each gap:"
            blocks.extend([head, table(row[idle[0]], IDLE_COLUMNS)])

    if row.get("top_kernels"):
        head = (
            f"\n{title}: a kernel running {row['critical_us_per_step']:.0f} us of {row['tpot_ms'] * 1e3:.0f} us per "
            f"step ({100 * row['gpu_busy']:.0f}%); durations sum to {row['kernel_us_per_step']:.0f} us (they overlap "
            "under programmatic dependent launch)"
        )
        tables(head, "the kernels", KERNEL_COLUMNS, ("top_kernels", "kernel_places"))
    if row.get("prefill_top_kernels"):
        head = (
            f"\n{title}, prefill of {row['context']} tokens ({row['prefill_ms']:.1f} ms timed): in the profiled one a "
            f"kernel ran {row['prefill_critical_us']:.0f} us of the {row['prefill_span_us']:.0f} us from the first "
            "kernel's start to the last one's end"
        )
        keys = ("prefill_top_kernels", "prefill_kernel_places", "prefill_idle")
        tables(head, "the prefill's kernels", PREFILL_KERNEL_COLUMNS, keys)
    return blocks
