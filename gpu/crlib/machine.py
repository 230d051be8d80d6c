"""The host and its GPUs: memory, nvidia-smi's view, CRIU's version."""

import os
import subprocess

from crlib import CRIU


def meminfo_gib():
    vals = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                vals[k] = int(v.split()[0]) / (1 << 20)
    except OSError:
        pass
    return vals


def machine_info():
    info = {"gpu": "unknown", "driver": "unknown"}
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30)
        first = r.stdout.strip().splitlines()[0]
        name, driver, mem = [x.strip() for x in first.split(",")]
        info.update(gpu=name, driver=driver, gpu_mem=mem)
    except Exception as e:
        info["nvidia_smi_error"] = repr(e)
    info["cpus"] = os.cpu_count()
    m = meminfo_gib()
    info["ram_gib"] = round(m.get("MemTotal", 0), 1)
    info["kernel"] = os.uname().release
    # the image storage's options (size, huge=) change the data rate
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[1] == "/dev/shm":
                    info["shm_options"] = fields[3]
    except OSError:
        pass
    try:
        r = subprocess.run([CRIU, "--version"], capture_output=True, text=True, timeout=30)
        info["criu"] = r.stdout.split("\n")[0].replace("Version:", "").strip() or None
    except Exception as e:
        info["criu_error"] = repr(e)
    return info


def gpu_uuids():
    """{CUDA ordinal (nvidia-smi index): UUID}; nvidia-smi orders GPUs by PCI bus like CUDA does
    when CUDA_DEVICE_ORDER=PCI_BUS_ID; the harness sets that for its workloads."""
    r = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    out = {}
    for line in r.stdout.strip().splitlines():
        idx, uuid = [x.strip() for x in line.split(",")]
        out[int(idx)] = uuid
    return out


def gpus_of_pids(pids):
    """UUIDs of the GPUs on which any of pids holds memory (nvidia-smi compute apps)."""
    want = {int(p) for p in pids if p}
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = set()
    for line in r.stdout.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in want:
            found.add(parts[1])
    return sorted(found)


def gpu_used_gib():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return round(float(r.stdout.strip().splitlines()[0]) / 1024, 2)
    except Exception:
        return None


def remount_shm(size="120G", log=None):
    if os.geteuid() != 0:
        return
    r = subprocess.run(["mount", "-o", "remount,size=" + size, "/dev/shm"],
                       capture_output=True, text=True)
    if log:
        log("remount /dev/shm size=%s: rc %d %s" % (size, r.returncode, r.stderr.strip()))
