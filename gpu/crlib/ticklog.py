"""gpu/workload.cu's log (a `ready` line, then one `tick` line per step) and the checker that
the computation went on bit-exact across checkpoints. gpu/mock_workload.py writes the same."""

import statistics

# Constants of gpu/workload.cu (the checker recomputes the state sequence).
LCG_A = 6364136223846793005
STATE0 = 0x243F6A8885A308D3
MASK64 = (1 << 64) - 1


def parse_workload_log(path):
    """Returns (ready: dict or None, ticks: [dict], errors: [str]) of gpu/workload.cu's log."""
    ready, ticks, errors = None, [], []
    try:
        with open(path, "r", errors="replace") as f:
            data = f.read()
    except OSError:
        return None, [], []
    lines = data.split("\n")
    if lines and lines[-1] != "":
        lines = lines[:-1]  # a line still being written
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "ready":
            ready = dict(zip(parts[1::2], parts[2::2]))
        elif parts[0] == "tick" and len(parts) >= 2:
            try:
                d = {"tick": int(parts[1])}
                kv = dict(zip(parts[2::2], parts[3::2]))
                for k in ("counter", "ok", "err", "us", "dt_us"):
                    d[k] = int(kv[k])
                d["state"] = int(kv["state"], 16)
                d["sum"] = int(kv["sum"], 16)
                ticks.append(d)
            except (KeyError, ValueError):
                errors.append("unparsable: " + line)
        elif parts[0] in ("error", "fatal:", "fatal"):
            errors.append(line)
    return ready, ticks, errors


def check_ticks(ready, ticks, errors, need_after=0, after_index=0, window=None):
    """The computation went on bit-exact: every tick ok, counter +1 per tick from 1,
    state = state * LCG_A + counter (recomputed here), sum == reference.

    need_after: ticks needed at index >= after_index. window: (t0, t1) in seconds
    (wall clock) of a dump; the largest gap between consecutive ticks that ends
    after t0 is reported as the pause."""
    problems = []
    if ready is None:
        problems.append("no ready line")
        ref = None
    else:
        ref = int(ready.get("ref", "0"), 16)
    state = STATE0
    for i, t in enumerate(ticks):
        where = "line %d (tick %d)" % (i, t["tick"])
        if t["tick"] != i:
            problems.append("%s: host tick %d, expected %d" % (where, t["tick"], i))
        if t["counter"] != i + 1:
            problems.append("%s: device counter %d, expected %d" % (where, t["counter"], i + 1))
        state = (state * LCG_A + (i + 1)) & MASK64
        if t["state"] != state:
            problems.append("%s: state %016x, expected %016x" % (where, t["state"], state))
            state = t["state"]  # resynchronise so one fault is reported once
        if ref is not None and t["sum"] != ref:
            problems.append("%s: sum %016x != reference %016x" % (where, t["sum"], ref))
        if t["ok"] != 1 or t["err"] != 0:
            problems.append("%s: ok %d err %d" % (where, t["ok"], t["err"]))
        if len(problems) > 20:
            problems.append("... (stopped after 20 problems)")
            break
    if errors:
        problems.append("%d error lines, first: %s" % (len(errors), errors[0]))
    after = max(0, len(ticks) - after_index)
    if after < need_after:
        problems.append("only %d ticks after index %d, need %d" % (after, after_index, need_after))
    gaps = [(ticks[i + 1]["us"] - ticks[i]["us"]) / 1e6 for i in range(len(ticks) - 1)]
    res = {"pass": not problems, "problems": problems, "n_ticks": len(ticks),
           "ticks_after": after, "median_gap_s": round(statistics.median(gaps), 4) if gaps else None,
           "max_gap_s": round(max(gaps), 4) if gaps else None}
    if window and gaps:
        t0 = window[0]
        cand = [(g, i) for i, g in enumerate(gaps) if ticks[i + 1]["us"] / 1e6 >= t0]
        if cand:
            g, i = max(cand)
            res["gap_s"] = round(g, 4)
            res["gap_ticks"] = [ticks[i]["tick"], ticks[i + 1]["tick"]]
            res["pause_s"] = round(max(0.0, g - (res["median_gap_s"] or 0)), 4)
    return res
