#!/usr/bin/env python3
"""A CUDA workload in a runc container, checkpointed and restored by the installed gpusnap
packages, on both paths (gpu/containers.sh runs it; see docs/containers.md).

What it does, on a host with the NVIDIA driver and nvcc and nothing else of the container stack:
1. installs the carried packages: `dpkg -i gpusnap_*.deb gpusnap-criu_*.deb` (the plugin in
   /usr/lib/criu, the agent, the CLI, the CDI spec /etc/cdi/gpusnap.json, CRIU as
   /usr/sbin/criu), and unpacks the carried runc (and busybox) .debs under the work dir;
2. builds gpu/workload.cu with gpu/build.sh and makes a rootfs of it: the workload, the host
   libraries it and the agent link (ldd), busybox for `sh`; no driver library in it;
3. makes an OCI bundle the way the NVIDIA container toolkit's CDI spec would: the device nodes
   /dev/nvidia* (linux.devices, allowed in the device cgroup) and the driver's libraries
   (libcuda.so.1 and the libraries it loads) bind-mounted read-only from the host; the host's
   network namespace (no netns to dump), its own pid, mount, ipc and uts namespaces;
4. on the split path applies the CDI device gpusnap.dev/agent=split from /etc/cdi/gpusnap.json
   to the bundle, as a CDI runtime does (its env and mounts); the transparent path has no agent;
5. per path: `runc checkpoint --leave-running` (the job goes on), `runc checkpoint` + `runc
   restore` of the same container, and `runc checkpoint` + `runc restore` into a new container
   (another id and bundle); after each, the workload's own check (crlib.ticklog: every tick ok,
   device counter and state sequence continuous, the checksum of all device data equal to the
   reference) decides `identical`.

`--standin` runs the same on a CPU-only host with the stand-in driver (fakegpu-vmm on
libfakecudadev.so, CRIU with libfakecuda.so): for trying the script, never for results.
"""

import argparse
import datetime
import glob
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--repo", required=True, help="the checkout (gpu/build.sh, gpu/crlib)")
ap.add_argument("--carry", required=True, help="directory with the .debs (and BUILD)")
ap.add_argument("--out", default=os.environ.get("OUT", "out"))
ap.add_argument("--work", default="/tmp/gpusnap-ctr")
ap.add_argument("--images", default="/dev/shm/gpusnap-ctr")
ap.add_argument("--gib", type=float, default=4.0)
ap.add_argument("--paths", default="transparent,split")
ap.add_argument("--deadline-s", type=float, default=360)
ap.add_argument("--standin", help="stand-in mode: a dir with libfakecudadev.so, fakegpu-vmm, libfakecuda.so")
ap.add_argument("--results-name", default="containers-h200")
a = ap.parse_args()

sys.path.insert(0, os.path.join(a.repo, "gpu"))
from crlib import ticklog  # noqa: E402

T0 = time.time()
os.makedirs(a.out, exist_ok=True)
LOG = open(os.path.join(a.out, "containers.log"), "a")
RESULTS = os.path.join(a.out, a.results_name + ".jsonl")
RUNC_ROOT = "/run/gpusnap-ctr-runc"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def say(*parts):
    line = "[ctr %s +%6.1fs] %s" % (time.strftime("%H:%M:%S"), time.time() - T0, " ".join(str(p) for p in parts))
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def sh(cmd, timeout=120, env=None, check=False, quiet=False):
    """Runs cmd (a list), logs it and its output; returns (rc, output, seconds)."""
    t = time.time()
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, errors="replace", timeout=timeout, env=env)
        rc, out = r.returncode, r.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += "\n(timed out after %d s)" % timeout
    except OSError as e:
        rc, out = 127, str(e)
    dt = time.time() - t
    say("$ %s  -> rc %d in %.2f s" % (" ".join(cmd), rc, dt))
    if out.strip() and not quiet:
        for line in out.rstrip().splitlines()[-40:]:
            LOG.write("    | " + line + "\n")
        LOG.flush()
    if check and rc != 0:
        raise RuntimeError("%s failed (rc %d): %s" % (" ".join(cmd), rc, out.strip()[-2000:]))
    return rc, out, dt


def left():
    return a.deadline_s - (time.time() - T0)


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ---------------------------------------------------------------- preflight and install
def preflight():
    info = {}
    try:
        with open("/etc/os-release") as f:
            info["os"] = dict(l.rstrip().split("=", 1) for l in f if "=" in l).get("PRETTY_NAME", "?").strip('"')
    except OSError:
        info["os"] = "unknown"
    info["kernel"] = os.uname().release
    rc, out, _ = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], quiet=True)
    info["gpu"] = out.strip().splitlines()[0] if rc == 0 and out.strip() else "none (rc %d)" % rc
    with open("/proc/mounts") as f:
        mounts = f.read()
    info["cgroup"] = [l.split()[2] + " " + l.split()[1] for l in mounts.splitlines() if l.split()[2] in ("cgroup", "cgroup2")][:3]
    info["dpkg"] = shutil.which("dpkg") is not None
    info["nvidia_devices"] = sorted(glob.glob("/dev/nvidia*"))
    rc, out, _ = sh(["nvcc", "--version"], quiet=True)
    info["nvcc"] = out.strip().splitlines()[-1] if rc == 0 and out.strip() else "none"
    say("preflight:", json.dumps(info))
    return info


def ensure_cgroup():
    with open("/proc/mounts") as f:
        for l in f:
            p = l.split()
            if p[1] == "/sys/fs/cgroup" and p[2] in ("cgroup2", "tmpfs"):
                return "mounted (%s)" % p[2]
    os.makedirs("/sys/fs/cgroup", exist_ok=True)
    rc, _, _ = sh(["mount", "-t", "cgroup2", "none", "/sys/fs/cgroup"])
    return "mounted cgroup2 by this script" if rc == 0 else "none (mount failed)"


def one(pattern):
    found = sorted(glob.glob(os.path.join(a.carry, pattern)))
    if not found:
        raise RuntimeError("nothing matches %s in %s" % (pattern, a.carry))
    return found[-1]


def install_packages():
    debs = [one("gpusnap_*_amd64.deb"), one("gpusnap-criu_*_amd64.deb")]
    for d in debs:
        sh(["dpkg-deb", "-f", d, "Package", "Version"], quiet=False)
    if shutil.which("dpkg"):
        sh(["dpkg", "-i"] + debs, timeout=300, check=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    else:
        raise RuntimeError("no dpkg on this host: the packages cannot be installed")
    sh(["sh", "-c", "PATH=%s; command -v criu; criu --version" % SYSTEM_PATH], check=True)
    sh(["/usr/bin/gpusnap", "check"], timeout=60)


def unpack(pattern, into):
    deb = one(pattern)
    os.makedirs(into, exist_ok=True)
    sh(["dpkg-deb", "-x", deb, into], check=True)
    return deb


def carried_runc():
    root = os.path.join(a.work, "runc-root")
    deb = unpack("runc_*_amd64.deb", root)
    runc = os.path.join(root, "usr", "sbin", "runc")
    env = dict(os.environ, PATH=SYSTEM_PATH)
    rc, out, _ = sh(["ldd", runc], quiet=True)
    if "not found" in out:
        unpack("libseccomp2_*_amd64.deb", root)
        env["LD_LIBRARY_PATH"] = os.path.join(root, "usr", "lib", "x86_64-linux-gnu")
        say("runc: using the carried libseccomp2 (the host has none)")
    sh([runc, "--version"], env=env, check=True)
    return runc, env, os.path.basename(deb)


def build_workload():
    """gpu/workload.cu with nvcc, as gpu/build.sh does (sm_90; libcuda from the linker's path,
    the toolkit's stub or the driver's file), only the workload."""
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/cuda-13/bin/nvcc") if os.path.exists(p)), None)
    if not nvcc:
        raise RuntimeError("nvcc not found")
    out = "/tmp/gpusnap-bin/workload"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    src = os.path.join(a.repo, "gpu", "workload.cu")
    cuda = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    links = [["-lcuda"], ["-L" + os.path.join(cuda, "lib64", "stubs"), "-lcuda"],
             ["-L" + os.path.join(cuda, "targets", "x86_64-linux", "lib", "stubs"), "-lcuda"]]
    links += [[p] for p in ("/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1") if os.path.exists(p)]
    for arch in (["-arch=sm_90"], []):
        for link in links:
            rc, _, _ = sh([nvcc, "-O2"] + arch + ["-o", out, src] + link, timeout=240)
            if rc == 0:
                return out
    raise RuntimeError("could not build gpu/workload.cu")


# ---------------------------------------------------------------- rootfs and bundle
def ldd_libs(binary):
    rc, out, _ = sh(["ldd", binary], quiet=True)
    libs = []
    for l in out.splitlines():
        parts = l.split("=>")
        path = (parts[1] if len(parts) > 1 else parts[0]).split()
        if path and path[0].startswith("/"):
            libs.append(path[0])
    return libs


def put(rootfs, src, dst):
    to = os.path.join(rootfs, dst.lstrip("/"))
    os.makedirs(os.path.dirname(to), exist_ok=True)
    shutil.copy2(os.path.realpath(src), to)


DRIVER_LIBS = ["libcuda.so.1", "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm.so.4", "libnvidia-ml.so.1",
               "libcudadebugger.so.1", "libnvidia-gpucomp.so"]


def driver_libs():
    """(host file, container path) for the driver libraries, by soname and by versioned name,
    in the directory the host has them in."""
    rc, out, _ = sh(["ldconfig", "-p"], quiet=True)
    where = {}
    for l in out.splitlines():
        l = l.strip()
        if "=>" in l:
            name = l.split()[0]
            path = l.split("=>")[1].strip()
            where.setdefault(name, path)
    for d in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"):
        for p in glob.glob(os.path.join(d, "lib*.so*")):
            where.setdefault(os.path.basename(p), p)
    binds = []
    for want in DRIVER_LIBS:
        hits = [n for n in where if n == want or (want.endswith(".so") and n.startswith(want + "."))]
        for n in hits:
            real = os.path.realpath(where[n])
            d = os.path.dirname(where[n])
            for name in {n, os.path.basename(real)}:
                binds.append((real, os.path.join(d, name)))
    binds = sorted(set(binds), key=lambda b: b[1])
    if not any(c.endswith("/libcuda.so.1") for _, c in binds):
        raise RuntimeError("no libcuda.so.1 on this host (ldconfig -p, /usr/local/nvidia/lib64)")
    return binds


def make_rootfs(workload, busybox, extra_bins):
    rootfs = os.path.join(a.work, "rootfs")
    shutil.rmtree(rootfs, ignore_errors=True)
    for d in ("bin", "dev", "proc", "sys", "tmp", "logs", "usr/local/bin", "usr/lib/gpusnap", "etc"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    put(rootfs, busybox, "/bin/busybox")
    os.symlink("busybox", os.path.join(rootfs, "bin", "sh"))
    put(rootfs, workload, "/usr/local/bin/" + os.path.basename(workload))
    libs = set(ldd_libs(workload)) | set(ldd_libs("/usr/lib/gpusnap/libgpusnap_agent.so"))
    for b, at in extra_bins:
        put(rootfs, b, at)
        libs |= set(ldd_libs(b))
    for lib in sorted(libs):
        if "libcuda.so" in lib or "libnvidia" in lib:
            continue  # the driver's: bind-mounted from the host
        put(rootfs, lib, lib)
    with open(os.path.join(rootfs, "etc", "passwd"), "w") as f:
        f.write("root:x:0:0:root:/:/bin/sh\n")
    return rootfs


def nvidia_devices():
    """linux.devices entries for the host's /dev/nvidia* character devices."""
    devs = []
    for p in sorted(glob.glob("/dev/nvidia*")):
        st = os.stat(p)
        if not stat.S_ISCHR(st.st_mode):
            continue
        devs.append({"path": p, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
                     "fileMode": 0o666, "uid": 0, "gid": 0})
    return devs


def apply_cdi(spec_path, device, cfg):
    """Applies a CDI device's containerEdits (env, mounts, deviceNodes) to an OCI config, as a
    CDI-aware runtime does; returns what it added."""
    with open(spec_path) as f:
        spec = json.load(f)
    kind, name = device.split("=", 1)
    if spec.get("kind") != kind:
        raise RuntimeError("%s declares kind %r, not %r" % (spec_path, spec.get("kind"), kind))
    dev = [d for d in spec.get("devices", []) if d.get("name") == name]
    if len(dev) != 1:
        raise RuntimeError("%s has no device %r" % (spec_path, name))
    added = {"env": [], "mounts": []}
    for edits in (spec.get("containerEdits") or {}, dev[0].get("containerEdits") or {}):
        for e in edits.get("env", []):
            k = e.split("=", 1)[0]
            cfg["process"]["env"] = [x for x in cfg["process"]["env"] if x.split("=", 1)[0] != k] + [e]
            added["env"].append(e)
        for m in edits.get("mounts", []):
            cfg["mounts"].append({"destination": m["containerPath"], "source": m["hostPath"],
                                  "type": m.get("type", "bind"), "options": m.get("options", ["ro", "bind"])})
            added["mounts"].append(m["containerPath"])
        if edits.get("deviceNodes") or edits.get("hooks"):
            raise RuntimeError("%s: deviceNodes/hooks are not applied by this script" % spec_path)
    return added


def bundle(name, rootfs, args, env, binds, devices, logs):
    b = os.path.join(a.work, "bundles", name)
    os.makedirs(b, exist_ok=True)
    cfg = {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": args, "cwd": "/",
                    "env": ["PATH=/usr/local/bin:/usr/bin:/bin"] + env,
                    "capabilities": {k: ["CAP_SYS_PTRACE", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE",
                                         "CAP_FOWNER", "CAP_SETUID", "CAP_SETGID"]
                                     for k in ("bounding", "effective", "permitted")},
                    "noNewPrivileges": True},
        "root": {"path": rootfs, "readonly": False},
        "hostname": name,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=1g"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/logs", "type": "bind", "source": logs, "options": ["rbind", "rw"]},
        ] + [{"destination": c, "type": "bind", "source": h, "options": ["ro", "nosuid", "nodev", "bind"]} for h, c in binds],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts")],
            "devices": devices,
            "resources": {"devices": [{"allow": False, "access": "rwm"}] + [
                {"allow": True, "type": "c", "major": d["major"], "minor": d["minor"], "access": "rwm"} for d in devices]},
        },
    }
    return b, cfg


def write_bundle(b, cfg):
    with open(os.path.join(b, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


# ---------------------------------------------------------------- the workload's log
def check_log(path, need_after, after_index):
    """identical: the workload's own check (real workload), or the stand-in's tick lines."""
    if a.standin:
        ticks = []
        try:
            with open(path) as f:
                ticks = [l.split() for l in f if l.startswith("tick ")]
        except OSError:
            pass
        problems = []
        for i, t in enumerate(ticks):
            if t != ["tick", str(i + 1), "counter", str(i + 1), "ok", "1"]:
                problems.append("line %d: %s" % (i, " ".join(t)))
        n = len(ticks)
        if n - after_index < need_after:
            problems.append("only %d ticks after %d" % (n - after_index, after_index))
        return {"pass": not problems, "problems": problems[:5], "n_ticks": n}
    ready, ticks, errors = ticklog.parse_workload_log(path)
    return ticklog.check_ticks(ready, ticks, errors, need_after=need_after, after_index=after_index)


def n_ticks(path):
    return check_log(path, 0, 0)["n_ticks"]


def wait_ticks(path, n, timeout):
    t = time.time()
    while time.time() - t < timeout:
        reap()
        if n_ticks(path) >= n:
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------- runc
class Runc:
    def __init__(self, runc, env):
        self.runc, self.env = runc, env

    def __call__(self, *args, timeout=120):
        return sh([self.runc, "--root", RUNC_ROOT] + list(args), timeout=timeout, env=self.env)

    def pid(self, cid):
        rc, out, _ = sh([self.runc, "--root", RUNC_ROOT, "state", cid], env=self.env, quiet=True)
        try:
            st = json.loads(out)
            return st.get("pid", 0) if st.get("status") == "running" else 0
        except ValueError:
            return 0

    def remove(self, cid):
        self("kill", cid, "KILL", timeout=30)
        time.sleep(0.3)
        reap()
        self("delete", "-f", cid, timeout=30)
        reap()


def criu_log_tail(work, name, n=25):
    p = os.path.join(work, name)
    try:
        with open(p, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "(no %s)" % p
    g = [l for l in lines if "gpusnap:" in l or "Error" in l or "rror (" in l]
    return "\n".join((g or lines)[-n:])


def drop_pages(img):
    """Frees the image's memory (/dev/shm) once its case is done; the logs and stats stay."""
    for f in glob.glob(os.path.join(img, "*.img")):
        os.unlink(f)


def taken_path(work, name):
    """The path gpusnap's lines in CRIU's log say it took (split, transparent), or None."""
    try:
        with open(os.path.join(work, name), errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    for p, needles in (("split", ("path split", "restored (Split path)")),
                       ("transparent", ("path transparent", "restored (Transparent path)"))):
        if any(n in text for n in needles):
            return p
    return None


def gpusnap_stats(images):
    try:
        with open(os.path.join(images, "gpusnap-stats.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main():
    info = preflight()
    build = open(os.path.join(a.carry, "BUILD")).read().strip() if os.path.exists(os.path.join(a.carry, "BUILD")) else "unknown"
    say("build", build)
    os.makedirs(a.work, exist_ok=True)
    shutil.rmtree(a.images, ignore_errors=True)
    os.makedirs(a.images, exist_ok=True)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: reap what runc leaves
    except Exception:
        pass
    install_packages()
    runc_bin, runc_env, runc_deb = carried_runc()
    runc = Runc(runc_bin, runc_env)
    bb_root = os.path.join(a.work, "busybox-root")
    bb_deb = unpack("busybox-static_*_amd64.deb", bb_root)
    busybox = os.path.join(bb_root, "bin", "busybox")
    info["cgroup_setup"] = ensure_cgroup()
    rc, criu_v, _ = sh(["/usr/sbin/criu", "--version"], quiet=True)
    criu_version = criu_v.split("\n")[0].replace("Version:", "").strip()
    rc, runc_v, _ = sh([runc_bin, "--version"], env=runc_env, quiet=True)
    runc_version = runc_v.split("\n")[0].strip()

    extra_bins, criu_env_extra = [], {}
    if a.standin:
        workload = os.path.join(a.standin, "fakegpu-vmm")
        extra_bins = [(os.path.join(a.standin, "libfakecudadev.so"), "/usr/local/lib/fakecuda/libcuda.so.1")]
        fake_dir = os.path.join(a.work, "fakecuda")
        os.makedirs(fake_dir, exist_ok=True)
        criu_env_extra = {"GPUSNAP_LIBCUDA": os.path.join(a.standin, "libfakecuda.so"), "FAKECUDA_DIR": fake_dir}
        binds, devices = [], []
    else:
        workload = build_workload()
        binds, devices = driver_libs(), nvidia_devices()
        say("driver libraries:", ", ".join(c for _, c in binds))
        say("device nodes:", ", ".join(d["path"] for d in devices))
    runc.env = dict(runc.env, **criu_env_extra)
    rootfs = make_rootfs(workload, busybox, extra_bins)
    lib_dirs = sorted({os.path.dirname(c) for _, c in binds})
    stack = {
        "host": "%s, kernel %s, %s; driver libraries and /dev/nvidia* from the host" % (info["os"], info["kernel"], info["gpu"]),
        "carried": "gpusnap + gpusnap-criu .debs (built on Debian 12 at %s; CRIU %s), %s (Debian 12, unpacked, not installed), %s (Debian 12, for sh in the rootfs)" % (
            build, criu_version, runc_deb, os.path.basename(bb_deb)),
        "rootfs": "directory: busybox, the workload built here by nvcc, the host libraries it and the agent link (ldd); no image registry, no Podman",
        "runtime": runc_version,
        "cgroup": info["cgroup_setup"],
    }
    say("stack:", json.dumps(stack))
    machine = {"gpu": info["gpu"], "os": info["os"], "kernel": info["kernel"], "cpus": os.cpu_count()}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    results = []

    def record(case, path, ok, identical=False, **kw):
        """ok: every command succeeded and the job ran on; identical: the workload's own check
        passed (bit-exact); pass: both, and gpusnap took the path asked for."""
        taken = [kw.get(k) for k in ("dump_path", "restore_path") if k in kw]
        right_path = all(t == path for t in taken)
        if not right_path:
            say("%s on the %s path: gpusnap took %s" % (case, path, taken))
        rec = {"case": case, "runtime": "runc " + runc_version.split()[-1], "path": path,
               "identical": bool(identical), "pass": bool(ok and identical and right_path),
               "gib": a.gib, "criu": criu_version, "build": build, "machine": machine, "date": date,
               "standin": bool(a.standin)}
        rec.update(kw)
        results.append(rec)
        with open(RESULTS, "a") as f:
            f.write(json.dumps(rec) + "\n")
        say("RESULT", json.dumps(rec))

    for path in [p for p in a.paths.split(",") if p]:
        if left() < 60:
            say("deadline: not starting path", path)
            break
        logs = os.path.join(a.work, "logs-" + path)
        shutil.rmtree(logs, ignore_errors=True)
        os.makedirs(logs)
        wlog = os.path.join(logs, "w.log")
        if a.standin:
            cmd = "exec /usr/local/bin/fakegpu-vmm --log /logs/w.log --seed 7 --allocs 2 --mib 4"
            env = ["LD_LIBRARY_PATH=/usr/local/lib/fakecuda", "FAKECUDADEV_STATE_PAGE=1"]
        else:
            cmd = "exec /usr/local/bin/workload --gib %g --alloc driver --log /logs/w.log" % a.gib
            env = ["LD_LIBRARY_PATH=" + ":".join(lib_dirs + ["/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"])]
        if path == "split":
            env.append("GPUSNAP_AGENT_DEBUG=1")
        args = ["/bin/sh", "-c", cmd + " >/logs/w.out 2>&1 </dev/null"]
        b1, cfg = bundle("ctr-" + path, rootfs, args, env, binds, devices, logs)
        cdi = None
        if path == "split":
            cdi = apply_cdi("/etc/cdi/gpusnap.json", "gpusnap.dev/agent=split", cfg)
            say("CDI gpusnap.dev/agent=split applied:", json.dumps(cdi))
        write_bundle(b1, cfg)
        # The new container of the last case: another id and bundle, the same rootfs and mounts.
        b2 = os.path.join(a.work, "bundles", "ctr-" + path + "-new")
        os.makedirs(b2, exist_ok=True)
        b2cfg = json.loads(json.dumps(cfg))
        b2cfg["hostname"] = "ctr-" + path + "-new"
        write_bundle(b2, b2cfg)
        cid, cid2 = "gpusnap-" + path, "gpusnap-" + path + "-new"
        for c in (cid, cid2):
            runc("delete", "-f", c, timeout=30)
        common = {"command_run": "runc run -d --bundle %s %s" % (b1, cid), "cdi": cdi,
                  "device_nodes": "linux.devices (made by runc)" if devices else None}
        try:
            rc, out, _ = runc("run", "-d", "--bundle", b1, cid)
            if rc != 0 and devices:
                # As the toolkit does in a user namespace: the device nodes bind-mounted from
                # the host instead of made in the container (still allowed in its cgroup).
                say("runc run failed with the device nodes in linux.devices; again with them bind-mounted")
                runc("delete", "-f", cid, timeout=30)
                for c in (cfg, b2cfg):
                    c["linux"]["devices"] = []
                    c["mounts"] += [{"destination": d["path"], "type": "bind", "source": d["path"],
                                     "options": ["rbind", "nosuid"]} for d in devices]
                write_bundle(b1, cfg)
                write_bundle(b2, b2cfg)
                common["device_nodes"] = "bind-mounted"
                rc, out, _ = runc("run", "-d", "--bundle", b1, cid)
            if rc != 0:
                raise RuntimeError("runc run failed: " + out.strip()[-1500:])
            ready = wait_ticks(wlog, 3, 180)
            if not ready:
                raise RuntimeError("the workload did not tick in 180 s: " + open(os.path.join(logs, "w.out"), errors="replace").read()[-1500:])
            pid = runc.pid(cid)
            maps = open("/proc/%d/maps" % pid).read() if pid else ""
            has_agent = "libgpusnap_agent.so" in maps
            say("container %s: host pid %d, agent mapped: %s" % (cid, pid, has_agent))
            if has_agent != (path == "split"):
                raise RuntimeError("agent mapped %s on the %s path" % (has_agent, path))

            # 1. --leave-running
            img, work = os.path.join(a.images, path + "-R"), os.path.join(a.images, path + "-R.work")
            before = n_ticks(wlog)
            cmdline = ["checkpoint", "--leave-running", "--image-path", img, "--work-path", work, cid]
            rc, out, dump_s = runc(*cmdline)
            ok = rc == 0 and wait_ticks(wlog, before + 5, 60) and runc.pid(cid) == pid
            res = check_log(wlog, 5, before)
            say(path, "leave-running:", json.dumps(res)[:800])
            say(criu_log_tail(work, "dump.log"))
            drop_pages(img)
            record("container-leave-running", path, ok, identical=res["pass"], dump_s=round(dump_s, 3), restore_s=None,
                   command="runc " + " ".join(cmdline), rc=rc, dump_path=taken_path(work, "dump.log"), check=res, stats=gpusnap_stats(img), **common)

            if left() < 40:
                raise RuntimeError("deadline: no time left for the remaining cases")
            # 2. checkpoint (stops) + restore of the same container
            img, work = os.path.join(a.images, path + "-1"), os.path.join(a.images, path + "-1.work")
            cp = ["checkpoint", "--image-path", img, "--work-path", work, cid]
            rc, out, dump_s = runc(*cp)
            at_dump = n_ticks(wlog)
            gone = runc.pid(cid) == 0
            time.sleep(0.5)
            still = n_ticks(wlog) == at_dump
            say(criu_log_tail(work, "dump.log"))
            rs = ["restore", "-d", "--image-path", img, "--work-path", work + "-r", "--bundle", b1, cid]
            rc2, out2, restore_s = runc(*rs)
            ok = rc == 0 and rc2 == 0 and gone and still and wait_ticks(wlog, at_dump + 5, 60)
            res = check_log(wlog, 5, at_dump)
            say(criu_log_tail(work + "-r", "restore.log"))
            say(path, "checkpoint+restore:", json.dumps(res)[:800])
            drop_pages(img)
            record("container-checkpoint-restore", path, ok, identical=res["pass"], dump_s=round(dump_s, 3),
                   restore_s=round(restore_s, 3), command="runc %s && runc %s" % (" ".join(cp), " ".join(rs)),
                   rc=[rc, rc2], dump_path=taken_path(work, "dump.log"),
                   restore_path=taken_path(work + "-r", "restore.log"), stopped_at_dump=gone and still, new_host_pid=runc.pid(cid), old_host_pid=pid,
                   check=res, stats=gpusnap_stats(img), **common)

            if left() < 40:
                raise RuntimeError("deadline: no time left for the remaining case")
            # 3. checkpoint (stops) + restore into a new container
            img, work = os.path.join(a.images, path + "-2"), os.path.join(a.images, path + "-2.work")
            cp = ["checkpoint", "--image-path", img, "--work-path", work, cid]
            rc, out, dump_s = runc(*cp)
            at_dump = n_ticks(wlog)
            runc("delete", "-f", cid, timeout=30)
            rs = ["restore", "-d", "--image-path", img, "--work-path", work + "-r", "--bundle", b2, cid2]
            rc2, out2, restore_s = runc(*rs)
            ok = rc == 0 and rc2 == 0 and wait_ticks(wlog, at_dump + 5, 60)
            res = check_log(wlog, 5, at_dump)
            say(criu_log_tail(work + "-r", "restore.log"))
            say(path, "restore into a new container:", json.dumps(res)[:800])
            drop_pages(img)
            record("container-restore-new", path, ok, identical=res["pass"], dump_s=round(dump_s, 3),
                   restore_s=round(restore_s, 3), command="runc %s && runc %s" % (" ".join(cp), " ".join(rs)),
                   rc=[rc, rc2], dump_path=taken_path(work, "dump.log"),
                   restore_path=taken_path(work + "-r", "restore.log"), new_container=cid2, check=res, stats=gpusnap_stats(img), **common)
        except Exception as e:
            say("FAILED path %s: %r" % (path, e))
            record("container-setup", path, False, dump_s=None, restore_s=None, error=str(e)[-3000:],
                   command=common["command_run"], **{k: v for k, v in common.items() if k != "command_run"})
        finally:
            for c in (cid, cid2):
                runc.remove(c)
    with open(os.path.join(a.out, "stack.json"), "w") as f:
        json.dump(stack, f, indent=1)
    pack_logs()
    failed = sum(not r["pass"] for r in results)
    say("done: %d cases, %d failed" % (len(results), failed))
    return 1 if failed else 0


def pack_logs():
    out = os.path.join(a.out, "containers-logs.tar.gz")
    with tarfile.open(out, "w:gz") as t:
        for pat in ("*/*.log", "*.work*/*.log", "*/gpusnap-stats.json"):
            for p in glob.glob(os.path.join(a.images, pat)):
                t.add(p, arcname=os.path.relpath(p, a.images))
        for p in glob.glob(os.path.join(a.work, "logs-*", "*")) + glob.glob(os.path.join(a.work, "bundles", "*", "config.json")):
            t.add(p, arcname=os.path.relpath(p, a.work))
    say("logs packed:", out, os.path.getsize(out), "bytes")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:
        say("FATAL: %r" % e)
        try:
            pack_logs()
        except Exception as e2:
            say("could not pack logs: %r" % e2)
        sys.exit(2)
