"""Turns the records of one benchmark run (a .jsonl written by bench/bench.py) into markdown.

Usage: python3 bench/report.py RESULTS.jsonl [--run ID] [-o OUT.md]
Without --run, the last run in the file is used. Prints to stdout without -o.
"""

import argparse
import json
import sys

GIB = float(1 << 30)


def fmt(x, nd=2):
    if x is None:
        return "-"
    if isinstance(x, float):
        return "%.*f" % (nd, x)
    return str(x)


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def flatten(d, prefix=""):
    """Numbers and short strings of a nested dict, as (dotted key, value)."""
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            out.extend(flatten(v, "%s%s." % (prefix, k)))
    elif isinstance(d, list):
        if len(d) <= 8:
            for i, v in enumerate(d):
                out.extend(flatten(v, "%s%d." % (prefix, i)))
        else:
            out.append((prefix[:-1], "[%d items]" % len(d)))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out.append((prefix[:-1], d))
    elif isinstance(d, (str, bool)) and len(str(d)) <= 60:
        out.append((prefix[:-1], d))
    return out


def render(recs, run):
    meta = next((r for r in recs if r.get("kind") == "meta"), {})
    pcie = next((r for r in recs if r.get("kind") == "pcie"), None)
    cases = [r for r in recs if r.get("kind") is None and "path" in r]
    first = recs[0]
    L = []
    L.append("# gpusnap: split path vs transparent path (%s)" % first.get("gpu", "?"))
    L.append("")
    L.append("- run: `%s`, date %s" % (run, first.get("date")))
    if meta.get("cmdline"):
        L.append("- command: `%s`" % meta["cmdline"])
    L.append("- machine: %s (%s), driver %s, %s CPUs, %s GiB RAM, kernel %s" % (
        first.get("gpu"), meta.get("gpu_mem", "?"), first.get("driver"), meta.get("cpus", "?"),
        meta.get("ram_gib", "?"), meta.get("kernel", "?")))
    if meta.get("criu") or meta.get("shm_options"):
        L.append("- CRIU %s; /dev/shm mounted `%s`" % (meta.get("criu", "?"), meta.get("shm_options", "?")))
    L.append("- workload: gpu/workload.cu, allocations %s of %s MiB; images on /dev/shm; times are "
             "wall clock from the start of `criu dump`/`criu restore` to its return" % (
                 meta.get("alloc", "driver"), meta.get("chunk_mib", 1024)))
    d2h = h2d = None
    if pcie:
        d2h, h2d = pcie.get("d2h_gbps"), pcie.get("h2d_gbps")
        L.append("- pinned PCIe (gpu/pcie_bw.cu, %s GiB, 64 MiB chunks, 4 streams, best of 3): "
                 "D2H %s GB/s, H2D %s GB/s" % (fmt((pcie.get("bytes") or 0) / GIB, 1), fmt(d2h),
                                                fmt(h2d)))
    else:
        L.append("- pinned PCIe: not measured in this run")
    L.append("")
    by = {}
    for r in cases:
        by[(r["gib"], r["path"])] = r
    sizes = sorted(set(r["gib"] for r in cases), key=float)
    L.append("| GiB | transparent dump s | transparent restore s | split dump s | split restore s "
             "| dump speedup | restore speedup | split dump GiB/s | split restore GiB/s "
             "| PCIe-bound dump s | PCIe-bound restore s | identical (T/S) |")
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")

    def cell(r, k):
        if r is None:
            return "-"
        if r.get("skipped"):
            return "skipped"
        if not r.get("pass", True) and r.get(k) is None:
            return "FAIL"
        return fmt(r.get(k), 2)

    for g in sizes:
        t, s = by.get((g, "transparent")), by.get((g, "split"))
        g_f = float(g)

        def val(r, k):
            # a failed case's times say how fast it failed: no speedup or rate from them
            if r is None or r.get("skipped") or not r.get("pass", True):
                return None
            return r.get(k)

        sd, sr = val(s, "dump_s"), val(s, "restore_s")
        td, tr = val(t, "dump_s"), val(t, "restore_s")
        pb_d = g_f * GIB / (d2h * 1e9) if d2h else None
        pb_r = g_f * GIB / (h2d * 1e9) if h2d else None

        def ident(r):
            if r is None:
                return "-"
            if r.get("skipped"):
                return "skip"
            return "yes" if r.get("identical") else "**NO**"

        L.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s/%s |" % (
            g, cell(t, "dump_s"), cell(t, "restore_s"), cell(s, "dump_s"), cell(s, "restore_s"),
            fmt(ratio(td, sd), 1) + ("x" if ratio(td, sd) else ""),
            fmt(ratio(tr, sr), 1) + ("x" if ratio(tr, sr) else ""),
            fmt(ratio(g_f, sd)), fmt(ratio(g_f, sr)), fmt(pb_d, 3), fmt(pb_r, 3), ident(t), ident(s)))
    L.append("")
    if d2h and h2d:
        L.append("PCIe in GiB/s: D2H %.2f, H2D %.2f. Split data rate as a share of PCIe:" % (
            d2h * 1e9 / GIB, h2d * 1e9 / GIB))
        for g in sizes:
            s = by.get((g, "split"))
            if s and not s.get("skipped") and s.get("dump_s") and s.get("restore_s"):
                L.append("- %s GiB: dump %.0f%%, restore %.0f%% (whole criu call, CPU state included)" % (
                    g, 100 * float(g) * GIB / s["dump_s"] / (d2h * 1e9),
                    100 * float(g) * GIB / s["restore_s"] / (h2d * 1e9)))
        L.append("")
    floors = [r for r in cases if r.get("floor_dump_s")]
    probes = {r.get("gib"): r for r in recs if r.get("kind") == "floor-probe"}
    failed_probes = [r for r in probes.values() if r.get("failed")]
    if floors or failed_probes:
        L.append("## Floor (this machine, this run)")
        L.append("")
    if floors and any(p.get("probe") == "ring" for p in probes.values()):
        tmpfs = {r.get("gib"): r for r in recs if r.get("kind") == "tmpfs-probe"}
        shape = next((p for p in probes.values() if p.get("probe") == "ring"), {})
        L.append("The floor of a split case (issue 14): its moved bytes (device bytes less zero and "
                 "referenced chunks) at the ring probe's rates, plus the driver's control checkpoint "
                 "or restore and CRIU's own part of the call (the call's time less gpusnap's phases), "
                 "both as measured in the case. The ring probe (`gpu/ring_probe.cu`) runs the split "
                 "path's data path without gpusnap at the case's size: device to a pinned ring of %s "
                 "x %s MiB on %s copy streams, %s writer threads each writing its own fresh file in "
                 "the image directory, then the same back (%s readers, host to device), every word "
                 "checked on the GPU afterwards; it is run twice and the second run counts (the "
                 "first pays the VM's first touch of guest memory). So the floor has the PCIe copies "
                 "and fresh data from RAM in it; what it leaves out is gpusnap's own set-up (ring, "
                 "release) and its per-chunk work (device hashes, manifest, hand-offs)." % (
                     shape.get("slots", "?"), shape.get("slot_mib", "?"), shape.get("streams", "?"),
                     shape.get("threads", "?"), shape.get("threads", "?")))
        L.append("")
        head = ("| GiB | ring probe write / read GB/s (first run) | floor dump s | split dump s | × floor "
                "| floor restore s | split restore s | × floor | data out, share of probe / PCIe "
                "| data in, share of probe / PCIe |")
        sep = "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        if tmpfs:
            head += " tmpfs alone write / read GB/s |"
            sep += "---|"
        L.append(head)
        L.append(sep)

        def pct(x):
            return fmt((x or 0) * 100, 0) + "%" if x is not None else "-"

        for r in floors:
            pr = probes.get(r["gib"]) or {}
            row = "| %s | %s / %s (%s / %s) | %s | %s | %s | %s | %s | %s | %s / %s | %s / %s |" % (
                r["gib"], fmt(pr.get("write_gbps")), fmt(pr.get("read_gbps")),
                fmt(pr.get("first_write_gbps")), fmt(pr.get("first_read_gbps")),
                fmt(r["floor_dump_s"], 3), fmt(r.get("dump_s")),
                fmt(ratio(r.get("dump_s"), r["floor_dump_s"]), 2),
                fmt(r.get("floor_restore_s"), 3), fmt(r.get("restore_s")),
                fmt(ratio(r.get("restore_s"), r.get("floor_restore_s")), 2),
                pct(r.get("data_out_share_of_floor")), pct(r.get("data_out_share_of_pcie")),
                pct(r.get("data_in_share_of_floor")), pct(r.get("data_in_share_of_pcie")))
            if tmpfs:
                tp = tmpfs.get(r["gib"]) or {}
                row += " %s / %s |" % (fmt(tp.get("write_gbps")), fmt(tp.get("read_gbps")))
            L.append(row)
        L.append("")
        L.append("Share of probe: gpusnap's data phase (`timings_s.data`) against the probe's rate "
                 "for the same bytes; share of PCIe: against pinned PCIe alone.")
        L.append("")
    elif floors:
        # runs before the ring probe (harness up to 0bb4bbb): the floor came from the tmpfs probe
        L.append("The floor of a split case: its moved bytes at the slower of pinned PCIe and tmpfs "
                 "(`gpu/tmpfs_probe.py` at the same size, second of two runs, so on touched memory), "
                 "plus the driver's control checkpoint or restore and CRIU's own part of the call, both "
                 "as measured in the case. What it leaves out is gpusnap's own set-up (ring, release). The "
                 "probe is Python: its reads can be slower than gpusnap's own, so a restore may come "
                 "out at or below its floor.")
        L.append("")
        L.append("| GiB | tmpfs write / read GB/s | floor dump s | split dump s | × floor | floor restore s "
                 "| split restore s | × floor | data out, share of PCIe | data in, share of PCIe |")
        L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in floors:
            pr = probes.get(r["gib"]) or {}
            L.append("| %s | %s / %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                r["gib"], fmt(pr.get("write_gbps")), fmt(pr.get("read_gbps")),
                fmt(r["floor_dump_s"], 3), fmt(r.get("dump_s")),
                fmt(ratio(r.get("dump_s"), r["floor_dump_s"]), 2),
                fmt(r.get("floor_restore_s"), 3), fmt(r.get("restore_s")),
                fmt(ratio(r.get("restore_s"), r.get("floor_restore_s")), 2),
                fmt((r.get("data_out_share_of_pcie") or 0) * 100, 0) + "%",
                fmt((r.get("data_in_share_of_pcie") or 0) * 100, 0) + "%"))
        L.append("")
    for r in failed_probes:
        L.append("- no floor at %s GiB: %s" % (r.get("gib"), r["failed"]))
    if failed_probes:
        L.append("")
    L.append("## Cases")
    L.append("")
    L.append("| GiB | path | result | dump s | restore s | image GiB | first tick after restore s | notes |")
    L.append("|---:|---|---|---:|---:|---:|---:|---|")
    for r in cases:
        if r.get("skipped"):
            L.append("| %s | %s | skipped | - | - | - | - | %s |" % (r["gib"], r["path"], r["skipped"]))
            continue
        L.append("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["gib"], r["path"], "PASS" if r.get("pass") else "FAIL", fmt(r.get("dump_s")),
            fmt(r.get("restore_s")), fmt((r.get("image_bytes") or 0) / GIB),
            fmt(r.get("first_tick_after_restore_s")),
            "; ".join(r.get("problems") or [])[:300].replace("|", "/")))
    L.append("")
    with_phases = [r for r in cases if r.get("phases")]
    if with_phases:
        L.append("## Phases (gpusnap-stats.json)")
        L.append("")
        for r in with_phases:
            L.append("### %s GiB, %s" % (r["gib"], r["path"]))
            L.append("")
            for k, v in flatten(r["phases"]):
                L.append("- `%s`: %s" % (k, fmt(v, 3)))
            L.append("")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("jsonl")
    ap.add_argument("--run", default=None)
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args()
    recs = []
    with open(a.jsonl) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
    if not recs:
        print("report.py: no records in %s" % a.jsonl, file=sys.stderr)
        return 1
    run = a.run or recs[-1].get("run")
    recs = [r for r in recs if r.get("run") == run]
    if not recs:
        print("report.py: no records of run %s" % run, file=sys.stderr)
        return 1
    text = render(recs, run)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
