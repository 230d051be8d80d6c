//! One containerd 2.x instance as a "node": its own root, state, gRPC and ttrpc sockets, runc
//! root and configuration, and its own `criu` wrapper first on its `PATH`.
//!
//! runc runs `criu swrk` from its `PATH` and sets no plugin directory in its RPC request, so
//! CRIU loads plugins from `$CRIU_LIBS_DIR` if set, else from `/usr/lib/criu`: the wrapper sets
//! `CRIU_LIBS_DIR` to the node's private plugin directory (the gpusnap plugin and its keeper),
//! the stand-in driver's variables (`GPUSNAP_LIBCUDA`, `FAKECUDA_DIR`), and runs the harness's
//! CRIU root (`GPUSNAP_CRIU_ROOT`, 4.1.1 or 4.2.x). Nothing is installed into the system.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criu_tests::podman::SYSTEM_PATH;
use criu_tests::procs;

use crate::cri::Cri;

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
}

impl Node {
    /// Writes the node's files under `dir` and starts its containerd from `containerd_root`;
    /// `pause` is the pinned sandbox image.
    pub fn start(
        name: &str,
        dir: &Path,
        containerd_root: &Path,
        criu: &CriuSetup,
        pause: &str,
    ) -> Result<Node, String> {
        let mk = |p: &Path| fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()));
        for sub in ["bin", "plugins", "fakecuda", "logs", "cni-bin", "cni-conf"] {
            mk(&dir.join(sub))?;
        }
        let copy = |from: &Path, to: PathBuf| {
            fs::copy(from, &to)
                .map(drop)
                .map_err(|e| format!("{} -> {}: {e}", from.display(), to.display()))
        };
        copy(&criu.plugin_so, dir.join("plugins/gpusnap.so"))?;
        copy(&criu.keeper, dir.join("plugins/gpusnap-keeper"))?;
        let wrapper = format!(
            "#!/bin/sh\n\
             # Node {name}'s criu (first on its containerd's PATH, so runc's): the harness's\n\
             # CRIU root, the gpusnap plugin from the node's own directory, the stand-in driver.\n\
             CRIU_LIBS_DIR='{plugins}'\n\
             GPUSNAP_CRIU_ROOT='{root}'\n\
             GPUSNAP_LIBCUDA='{so}'\n\
             FAKECUDA_DIR='{fake}'\n\
             export CRIU_LIBS_DIR GPUSNAP_CRIU_ROOT GPUSNAP_LIBCUDA FAKECUDA_DIR\n\
             exec '{criu}' \"$@\"\n",
            plugins = dir.join("plugins").display(),
            root = criu.criu_root.display(),
            so = criu.fakecuda_so.display(),
            fake = dir.join("fakecuda").display(),
            criu = criu.criu.display(),
        );
        let w = dir.join("bin/criu");
        fs::write(&w, wrapper).map_err(|e| format!("{}: {e}", w.display()))?;
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&w, fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", w.display()))?;
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
             [plugins.'io.containerd.cri.v1.runtime']\n  enable_cdi = false\n\
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
