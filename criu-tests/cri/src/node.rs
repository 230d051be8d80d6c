//! One containerd 2.x instance as a "node": its own root, state, gRPC and ttrpc sockets, runc
//! root and configuration, and its own `criu` wrapper first on its `PATH`.
//!
//! runc runs `criu swrk` from its `PATH` and sets no plugin directory in its RPC request, so
//! CRIU loads plugins from `$CRIU_LIBS_DIR` if set, else from `/usr/lib/criu`: the wrapper sets
//! `CRIU_LIBS_DIR` to the node's private plugin directory (the gpusnap plugin and its keeper),
//! the stand-in driver's variables (`GPUSNAP_LIBCUDA`, `FAKECUDA_DIR`), and runs the harness's
//! CRIU root (`GPUSNAP_CRIU_ROOT`, 4.1.1 or 4.2.x). Nothing is installed into the system.
//!
//! Each node reads CDI specs (Container Device Interface) from its own directory (`cdi/`,
//! containerd's `cdi_spec_dirs`) only. Given the agent, a node's spec there is the package's
//! `/etc/cdi/gpusnap.json` with the node's own copy of the agent: device [`CDI_DEVICE`]
//! bind-mounts it read-only at [`AGENT_IN_CONTAINER`] and sets `LD_PRELOAD` to it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criu_tests::podman::SYSTEM_PATH;
use criu_tests::procs;

use crate::cri::Cri;

/// A node's stand-in GPUs, kernel driver and gpusnap configuration, as its `criu` wrapper
/// gives them to CRIU (and so to gpusnap): `FAKECUDA_DEVICES`, `FAKECUDA_UUID_SALT`,
/// `FAKECUDA_DEVICE_NAME` for the stand-in driver; a listing laid out like
/// `/proc/driver/nvidia/gpus` (`GPUSNAP_TEST_NVIDIA_PROC`) and a version file like
/// `/proc/driver/nvidia/version` (`GPUSNAP_TEST_NVIDIA_VERSION`) for what gpusnap reads of the
/// kernel driver; `GPUSNAP_CONFIG` for the node's own `gpusnap.conf`.
#[derive(Debug, Clone)]
pub struct NodeGpus {
    /// How many GPUs (1 to 8).
    pub devices: usize,
    /// Byte 4 of every UUID (0: the stand-in's own UUIDs).
    pub uuid_salt: u8,
    /// Another model than the stand-in's `Fake GPU`, for the driver and the listing alike.
    pub model: Option<String>,
    /// The kernel driver's version, e.g. `580.95.05`.
    pub kernel_driver: String,
    /// The text of the node's `gpusnap.conf`.
    pub config: String,
}

impl NodeGpus {
    /// `devices` stand-in GPUs with UUID salt `uuid_salt` on kernel driver `kernel_driver`, the
    /// default configuration.
    pub fn new(devices: usize, uuid_salt: u8, kernel_driver: &str) -> NodeGpus {
        NodeGpus {
            devices,
            uuid_salt,
            model: None,
            kernel_driver: kernel_driver.into(),
            config: String::new(),
        }
    }

    /// The UUID of GPU `index`, spelt `GPU-xxxxxxxx-xxxx-...` (as the stand-in driver makes it:
    /// `fa4ec0da-<salt>00-4000-8000-0000000000<index + 1>`).
    pub fn uuid(&self, index: usize) -> String {
        format!(
            "GPU-fa4ec0da-{:02x}00-4000-8000-{:012x}",
            self.uuid_salt,
            index + 1
        )
    }

    fn model(&self) -> &str {
        self.model.as_deref().unwrap_or("Fake GPU")
    }
}

/// Writes node `name`'s `criu` wrapper, its kernel-driver files and `gpusnap.conf` under `dir`.
fn write_criu_wrapper(
    name: &str,
    dir: &Path,
    criu: &CriuSetup,
    gpus: &NodeGpus,
) -> Result<(), String> {
    let err = |p: &Path| {
        let p = p.display().to_string();
        move |e: std::io::Error| format!("{p}: {e}")
    };
    let listing = dir.join("nvidia-gpus");
    let _ = fs::remove_dir_all(&listing);
    for i in 0..gpus.devices {
        let bus = listing.join(format!("0000:{:02x}:00.0", 0x10 + i));
        fs::create_dir_all(&bus).map_err(err(&bus))?;
        let info = bus.join("information");
        fs::write(
            &info,
            format!(
                "Model: \t\t {}\nIRQ:   \t\t {}\nGPU UUID: \t {}\nBus Location: \t {}\n",
                gpus.model(),
                100 + i,
                gpus.uuid(i),
                bus.file_name().unwrap_or_default().to_string_lossy()
            ),
        )
        .map_err(err(&info))?;
    }
    let version = dir.join("nvidia-version");
    fs::write(
        &version,
        format!(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {}  Tue Sep 23 09:55:41 UTC 2025\n\
             GCC version:  gcc version 12.2.0\n",
            gpus.kernel_driver
        ),
    )
    .map_err(err(&version))?;
    let conf = dir.join("gpusnap.conf");
    fs::write(&conf, &gpus.config).map_err(err(&conf))?;
    let logs = dir.join("criu-logs");
    fs::create_dir_all(&logs).map_err(err(&logs))?;
    let model = match &gpus.model {
        Some(m) => format!("FAKECUDA_DEVICE_NAME='{m}'\nexport FAKECUDA_DEVICE_NAME\n"),
        None => String::new(),
    };
    let keeper = match &criu.keeper_libcuda {
        Some(l) => format!(
            "GPUSNAP_TEST_KEEPER_LIBCUDA='{}'\nexport GPUSNAP_TEST_KEEPER_LIBCUDA\n",
            l.display()
        ),
        None => String::new(),
    };
    let salt = match gpus.uuid_salt {
        0 => String::new(),
        s => format!("FAKECUDA_UUID_SALT={s}\nexport FAKECUDA_UUID_SALT\n"),
    };
    let wrapper = format!(
        "#!/bin/sh\n\
         # Node {name}'s criu (first on its containerd's PATH, so runc's): the harness's\n\
         # CRIU root, the gpusnap plugin from the node's own directory, its gpusnap.conf, the\n\
         # stand-in driver with the node's GPUs, the node's kernel-driver files.\n\
         CRIU_LIBS_DIR='{plugins}'\n\
         GPUSNAP_CRIU_ROOT='{root}'\n\
         GPUSNAP_CONFIG='{conf}'\n\
         GPUSNAP_LIBCUDA='{so}'\n\
         GPUSNAP_TEST_NVIDIA_PROC='{listing}'\n\
         GPUSNAP_TEST_NVIDIA_VERSION='{version}'\n\
         FAKECUDA_DIR='{fake}'\n\
         FAKECUDA_DEVICES={devices}\n\
         export CRIU_LIBS_DIR GPUSNAP_CRIU_ROOT GPUSNAP_CONFIG GPUSNAP_LIBCUDA \\\n\
         \x20 GPUSNAP_TEST_NVIDIA_PROC GPUSNAP_TEST_NVIDIA_VERSION FAKECUDA_DIR FAKECUDA_DEVICES\n\
         {model}{salt}{keeper}\
         # A failed restore's bundle goes with its task, restore.log with it: keep copies.\n\
         '{criu}' \"$@\"\n\
         rc=$?\n\
         for f in '{tasks}'/*/work/restore.log; do\n\
         \x20 [ -f \"$f\" ] && cp \"$f\" '{logs}'/\"$(basename \"$(dirname \"$(dirname \"$f\")\")\")\"-restore.log\n\
         done\n\
         exit $rc\n",
        plugins = dir.join("plugins").display(),
        root = criu.criu_root.display(),
        conf = conf.display(),
        so = criu.fakecuda_so.display(),
        listing = listing.display(),
        version = version.display(),
        fake = dir.join("fakecuda").display(),
        devices = gpus.devices,
        criu = criu.criu.display(),
        logs = logs.display(),
        tasks = dir.join(TASKS).display(),
    );
    let w = dir.join("bin/criu");
    // Replaced, not rewritten in place: a `criu` running now keeps reading its own copy.
    let tmp = dir.join("bin/.criu.new");
    fs::write(&tmp, wrapper).map_err(err(&tmp))?;
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)).map_err(err(&tmp))?;
    fs::rename(&tmp, &w).map_err(err(&w))
}

/// The CDI device that gives a container the agent (the package's name for it).
pub const CDI_DEVICE: &str = "gpusnap.dev/agent=split";
/// Where the CDI device puts the agent in the container (as the package's spec does).
pub const AGENT_IN_CONTAINER: &str = "/usr/lib/gpusnap/libgpusnap_agent.so";

/// The node's CDI spec: [`CDI_DEVICE`], mounting `agent` (a host path) at
/// [`AGENT_IN_CONTAINER`] read-only and preloading it. cdiVersion 0.3.0 (env and mounts only), as
/// `scripts/build-deb.sh` writes it.
fn cdi_spec(agent: &Path) -> String {
    let (kind, name) = CDI_DEVICE.split_once('=').expect("kind=name");
    serde_json::to_string_pretty(&serde_json::json!({
        "cdiVersion": "0.3.0",
        "kind": kind,
        "devices": [{
            "name": name,
            "containerEdits": {
                "env": [format!("LD_PRELOAD={AGENT_IN_CONTAINER}")],
                "mounts": [{
                    "hostPath": agent.display().to_string(),
                    "containerPath": AGENT_IN_CONTAINER,
                    "options": ["ro", "nosuid", "nodev", "bind"],
                }],
            },
        }],
    }))
    .expect("serialize the CDI spec")
}

/// Where containerd keeps its tasks' bundles, below a node's directory.
const TASKS: &str = "state/io.containerd.runtime.v2.task/k8s.io";

/// A running containerd; [`Node::shut_down`] (or dropping it) stops it and what it started.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub dir: PathBuf,
    pub sock: PathBuf,
    /// The stand-in driver's state and logs for this node's CRIU.
    pub fakecuda: PathBuf,
    /// Pod log directories.
    pub logs: PathBuf,
    pub ctr: PathBuf,
    child: Option<Child>,
    criu: CriuSetup,
    pub cri: Option<Cri>,
    /// (pod id, container ids) the test created, removed at shut-down.
    pub pods: Vec<(String, Vec<String>)>,
}

/// What a node's `criu` wrapper runs.
#[derive(Debug, Clone)]
pub struct CriuSetup {
    /// `scripts/criu`.
    pub criu: PathBuf,
    /// The CRIU root it runs.
    pub criu_root: PathBuf,
    pub plugin_so: PathBuf,
    pub keeper: PathBuf,
    /// The stand-in driver (`libfakecuda.so`).
    pub fakecuda_so: PathBuf,
    /// The split path: the agent (`libgpusnap_agent.so`), copied into the node and given to
    /// containers by its CDI spec ([`CDI_DEVICE`]).
    pub agent: Option<PathBuf>,
    /// The split path: the driver library a keeper loads (`GPUSNAP_TEST_KEEPER_LIBCUDA`; the
    /// device stand-in, which the jobs load as their `libcuda.so.1`).
    pub keeper_libcuda: Option<PathBuf>,
}

impl Node {
    /// Writes the node's files under `dir` and starts its containerd from `containerd_root`;
    /// `pause` is the pinned sandbox image.
    pub fn start(
        name: &str,
        dir: &Path,
        containerd_root: &Path,
        criu: &CriuSetup,
        gpus: &NodeGpus,
        pause: &str,
    ) -> Result<Node, String> {
        let mk = |p: &Path| fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()));
        for sub in [
            "bin", "plugins", "fakecuda", "logs", "cni-bin", "cni-conf", "cdi", "agent",
        ] {
            mk(&dir.join(sub))?;
        }
        let copy = |from: &Path, to: PathBuf| {
            fs::copy(from, &to)
                .map(drop)
                .map_err(|e| format!("{} -> {}: {e}", from.display(), to.display()))
        };
        copy(&criu.plugin_so, dir.join("plugins/gpusnap.so"))?;
        copy(&criu.keeper, dir.join("plugins/gpusnap-keeper"))?;
        if let Some(agent) = &criu.agent {
            let copy_at = dir.join("agent/libgpusnap_agent.so");
            copy(agent, copy_at.clone())?;
            let spec = dir.join("cdi/gpusnap.json");
            fs::write(&spec, cdi_spec(&copy_at)).map_err(|e| format!("{}: {e}", spec.display()))?;
        }
        write_criu_wrapper(name, dir, criu, gpus)?;
        let sock = dir.join("containerd.sock");
        let d = dir.display();
        let config = format!(
            "# Node {name}: containerd 2.x for the gpusnap CRI test.\n\
             version = 3\n\
             root = '{d}/root'\n\
             state = '{d}/state'\n\
             [grpc]\n  address = '{d}/containerd.sock'\n\
             [ttrpc]\n  address = '{d}/containerd.sock.ttrpc'\n\
             [plugins]\n\
             [plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n\
             [plugins.'io.containerd.cri.v1.images'.pinned_images]\n  sandbox = '{pause}'\n\
             [plugins.'io.containerd.cri.v1.runtime']\n\
             \x20 # CDI devices from this node's directory only (not /etc/cdi, /var/run/cdi).\n\
             \x20 enable_cdi = true\n  cdi_spec_dirs = ['{d}/cdi']\n\
             \x20 # runc cannot give the pause container -998 without CAP_SYS_RESOURCE.\n\
             \x20 restrict_oom_score_adj = true\n\
             [plugins.'io.containerd.cri.v1.runtime'.containerd]\n  default_runtime_name = 'runc'\n\
             [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n  runtime_type = 'io.containerd.runc.v2'\n\
             [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]\n  SystemdCgroup = false\n  Root = '{d}/runc'\n\
             [plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = ['{d}/cni-bin']\n  conf_dir = '{d}/cni-conf'\n\
             [plugins.'io.containerd.grpc.v1.cri']\n  stream_server_address = '127.0.0.1'\n  stream_server_port = '0'\n\
             # Two instances would share /var/run/nri/nri.sock.\n\
             [plugins.'io.containerd.nri.v1.nri']\n  disable = true\n\
             [plugins.'io.containerd.internal.v1.opt']\n  path = '{d}/opt'\n"
        );
        let conf = dir.join("config.toml");
        fs::write(&conf, config).map_err(|e| format!("{}: {e}", conf.display()))?;
        let bin = containerd_root.join("usr/bin");
        let path = format!(
            "{}:{}:{SYSTEM_PATH}",
            dir.join("bin").display(),
            bin.display()
        );
        let log = fs::File::create(dir.join("containerd.log")).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(bin.join("containerd"));
        cmd.arg("--config")
            .arg(&conf)
            .env_clear()
            .env("PATH", path)
            .env("HOME", dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let child = procs::spawn_in_new_session(&mut cmd)
            .map_err(|e| format!("starting containerd for node {name}: {e}"))?;
        let mut node = Node {
            name: name.into(),
            dir: dir.to_owned(),
            sock: sock.clone(),
            fakecuda: dir.join("fakecuda"),
            logs: dir.join("logs"),
            ctr: bin.join("ctr"),
            child: Some(child),
            criu: criu.clone(),
            cri: None,
            pods: Vec::new(),
        };
        let t0 = Instant::now();
        while !sock.exists() {
            if t0.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "node {name}: containerd did not open {} within 30 s:\n{}",
                    sock.display(),
                    node.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        node.cri = Some(
            Cri::connect(&sock, Duration::from_secs(30))
                .map_err(|e| format!("node {name}: {e}\n{}", node.log()))?,
        );
        Ok(node)
    }

    /// Gives the node other stand-in GPUs, kernel driver or gpusnap configuration: the next
    /// `criu` runc starts sees them (containerd keeps running).
    pub fn set_gpus(&self, gpus: &NodeGpus) -> Result<(), String> {
        write_criu_wrapper(&self.name, &self.dir, &self.criu, gpus)
    }

    /// The CRIU restore log of container `id`: in the task's bundle
    /// (`state/io.containerd.runtime.v2.task/k8s.io/<id>/work/restore.log`, which runc's error
    /// names) while the task exists,
    /// else the copy this node's `criu` wrapper made of it (`criu-logs/<id>-restore.log`; a
    /// failed restore's bundle is removed with its task). Empty when there is none.
    pub fn restore_log(&self, id: &str) -> String {
        fs::read_to_string(self.dir.join(TASKS).join(id).join("work/restore.log"))
            .or_else(|_| {
                fs::read_to_string(self.dir.join("criu-logs").join(format!("{id}-restore.log")))
            })
            .unwrap_or_default()
    }

    /// CRIU's log of a checkpoint of container `id` that failed: runc's `criu-dump.log` in the
    /// task's bundle, which runc's error names (a checkpoint that succeeds has its log in the
    /// archive, `dump.log`); empty when there is none.
    pub fn failed_dump_log(&self, id: &str) -> String {
        fs::read_to_string(self.dir.join(TASKS).join(id).join("criu-dump.log")).unwrap_or_default()
    }

    pub fn cri(&mut self) -> &mut Cri {
        self.cri.as_mut().expect("connected")
    }

    /// containerd's log.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// `ctr -a <sock> -n k8s.io <args>`, bounded in time.
    pub fn ctr(&self, args: &[&str]) -> Result<criu_tests::podman::Output, String> {
        let mut cmd = Command::new(&self.ctr);
        cmd.arg("-a")
            .arg(&self.sock)
            .args(["-n", "k8s.io"])
            .args(args);
        criu_tests::podman::run_bounded(
            &mut cmd,
            &format!("ctr {}", args.join(" ")),
            &self.dir,
            Duration::from_secs(120),
        )
    }

    /// Stops and removes the test's containers and pods (best effort), stops containerd, kills
    /// what is left of the processes it started (shims and their children, found by this
    /// node's directory in their command line or root), and unmounts what it left mounted.
    pub fn shut_down(&mut self) {
        if let Some(mut cri) = self.cri.take() {
            for (pod, ctrs) in std::mem::take(&mut self.pods) {
                for c in &ctrs {
                    let _ = cri.stop_container(c);
                    let _ = cri.remove_container(c);
                }
                let _ = cri.stop_pod(&pod);
                let _ = cri.remove_pod(&pod);
            }
        }
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on the pid of containerd, which this process started.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let t0 = Instant::now();
            while matches!(c.try_wait(), Ok(None)) && t0.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // The shims (reparented to this subreaper) and the containers' processes.
        let dir = self.dir.display().to_string();
        let mut left = Vec::new();
        if let Ok(entries) = fs::read_dir("/proc") {
            for e in entries.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let root = fs::read_link(format!("/proc/{pid}/root")).unwrap_or_default();
                if String::from_utf8_lossy(&cmdline).contains(&dir)
                    || root.display().to_string().starts_with(&dir)
                {
                    left.push(pid);
                }
            }
        }
        procs::kill_and_reap(&left);
        criu_tests::podman::reap_zombies();
        unmount_under(&self.dir);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Unmounts what a failed restore left of node `dir`: containerd's read-only view of the
/// checkpoint image under `/tmp/checkpoint*` (the node's pods keep their mounts).
pub fn unmount_checkpoint_views(dir: &Path) {
    let d = dir.display().to_string();
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for l in mounts.lines().filter(|l| l.contains(&d)) {
        let Some(point) = l.split_whitespace().nth(4) else {
            continue;
        };
        if point.starts_with("/tmp/checkpoint") {
            let c = std::ffi::CString::new(point).expect("no NUL in a mount point");
            // SAFETY: umount2 reads a NUL-terminated path; MNT_DETACH never blocks.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            let _ = fs::remove_dir(point);
        }
    }
}

/// Unmounts (lazily, deepest first) every mount point under `dir`, and every mount whose
/// options name `dir` (containerd's view of a checkpoint image under `/tmp/checkpoint*`, left
/// after a failed restore, is an overlay of this node's snapshots).
pub fn unmount_under(dir: &Path) {
    let d = dir.display().to_string();
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<String> = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let point = f.get(4)?;
            (point.starts_with(&d) || l.contains(&d)).then(|| point.replace("\\040", " "))
        })
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    points.dedup();
    for p in points {
        let c = std::ffi::CString::new(p.clone()).expect("no NUL in a mount point");
        // SAFETY: umount2 reads a NUL-terminated path; MNT_DETACH never blocks.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        if p.starts_with("/tmp/checkpoint") {
            let _ = fs::remove_dir(&p);
        }
    }
}
