//! A stand-in AMD KFD for tests with real CRIU (see `gpusnap_rocm::kfd::standin` for the
//! directory layout and the wire protocol, and `src/bin/fake-kfd.rs` for the daemon that plays
//! the kernel).
//!
//! This library sets a stand-in up ([`StandinSetup`]): the device nodes (`mknod` of the FUSE
//! misc device 10:229, a character device CRIU does not dump itself, so a process holding it
//! reaches the plugins' `DUMP_EXT_FILE`/`RESTORE_EXT_FILE` as `/dev/kfd` does), a topology tree
//! in the kernel's sysfs layout, and the daemon; and it gives tests the daemon's test-only
//! requests (status of a KFD process, injected failures).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpusnap_rocm::kfd::standin::{self, StandinKfd, request};

/// The device number the stand-in's nodes get: the FUSE misc device, which CRIU hands to
/// plugins (`files-ext.c`: "Can't dump file ... of that type (chr 10:229)" when none takes it).
pub const NODE_MAJOR: u32 = 10;
pub const NODE_MINOR: u32 = 229;

/// One stand-in GPU of the topology.
#[derive(Debug, Clone)]
pub struct FakeGpu {
    pub gpu_id: u32,
    pub render_minor: u32,
    pub device_id: u32,
    pub gfx_target_version: u32,
    pub simd_count: u32,
    pub vram_bytes: u64,
}

impl FakeGpu {
    /// An MI210-like GPU (1002:740f gfx90a, 104 CUs, 64 GiB) with these numbers.
    pub fn mi210(gpu_id: u32, render_minor: u32) -> FakeGpu {
        FakeGpu {
            gpu_id,
            render_minor,
            device_id: 0x740f,
            gfx_target_version: 90010,
            simd_count: 416,
            vram_bytes: 64 << 30,
        }
    }
}

/// Writes a KFD topology tree (CPU node 0, then one node per GPU) under `dir`.
pub fn write_topology(dir: &Path, gpus: &[FakeGpu]) -> std::io::Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    let nodes = dir.join("nodes");
    std::fs::create_dir_all(nodes.join("0"))?;
    std::fs::write(dir.join("generation_id"), "1\n")?;
    std::fs::write(nodes.join("0/gpu_id"), "0\n")?;
    std::fs::write(
        nodes.join("0/properties"),
        "cpu_cores_count 2\nsimd_count 0\nvendor_id 0\ndevice_id 0\n",
    )?;
    for (i, g) in gpus.iter().enumerate() {
        let n = nodes.join((i + 1).to_string());
        std::fs::create_dir_all(n.join("mem_banks/0"))?;
        std::fs::write(n.join("gpu_id"), format!("{}\n", g.gpu_id))?;
        std::fs::write(n.join("name"), "\n")?;
        std::fs::write(
            n.join("properties"),
            format!(
                "cpu_cores_count 0\nsimd_count {}\nvendor_id 4098\ndevice_id {}\n\
                 location_id {}\ndomain 0\ndrm_render_minor {}\ngfx_target_version {}\n\
                 local_mem_size 0\n",
                g.simd_count,
                g.device_id,
                (0xc3 + i as u32) << 8,
                g.render_minor,
                g.gfx_target_version
            ),
        )?;
        std::fs::write(
            n.join("mem_banks/0/properties"),
            format!("heap_type 1\nsize_in_bytes {}\n", g.vram_bytes),
        )?;
    }
    Ok(())
}

/// `mknod path c 10 229`, replacing what is there.
pub fn make_node(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: mknod with a NUL-terminated path.
    let rc = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o600,
            libc::makedev(NODE_MAJOR, NODE_MINOR),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Size of the sparse store behind each block node: the stand-in's mmap offsets (which the
/// daemon gives out 4 GiB apart per KFD process) must lie inside it.
pub const NODE_STORE_BYTES: u64 = 1 << 40;

/// A loop block device over a sparse file, detached when dropped.
#[derive(Debug)]
pub struct LoopDevice {
    pub dev: PathBuf,
    pub rdev: u64,
}

impl LoopDevice {
    /// Attaches a loop device to a new sparse file `store` of [`NODE_STORE_BYTES`].
    pub fn attach(store: &Path) -> Result<LoopDevice, String> {
        let f = std::fs::File::create(store).map_err(|e| format!("{}: {e}", store.display()))?;
        f.set_len(NODE_STORE_BYTES)
            .map_err(|e| format!("{}: {e}", store.display()))?;
        drop(f);
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(store)
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "losetup -f --show {}: {}",
                store.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        use std::os::unix::fs::MetadataExt;
        let rdev = std::fs::metadata(&dev)
            .map_err(|e| format!("{}: {e}", dev.display()))?
            .rdev();
        Ok(LoopDevice { dev, rdev })
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// `mknod path b <major> <minor>` of `rdev`, replacing what is there.
pub fn make_block_node(path: &Path, rdev: u64) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: mknod with a NUL-terminated path.
    if unsafe { libc::mknod(c.as_ptr(), libc::S_IFBLK | 0o600, rdev) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A stand-in KFD directory with its daemon running. The daemon is killed when dropped.
///
/// The `kfd` and `renderD*` nodes are block-device nodes of loop devices over sparse files:
/// a block device is a non-regular file CRIU does not dump itself, so a process holding one
/// reaches the plugins' `DUMP_EXT_FILE`/`RESTORE_EXT_FILE` (as `/dev/kfd` does), and, unlike
/// the FUSE device, it can be mapped, so a process's mappings of it reach `HANDLE_DEVICE_VMA`
/// and `UPDATE_VMA_MAP` as the real device's do. The daemon writes, at each buffer object's
/// mmap offset of the node it is mapped through, a tag naming the BO (and a stale mark at the
/// old offset once a BO is restored elsewhere): a mapping shows the tag of its BO only when it
/// was made at the BO's current offset of the right node.
#[derive(Debug)]
pub struct StandinSetup {
    pub dir: PathBuf,
    pub gpus: Vec<FakeGpu>,
    daemon: Option<Child>,
    loops: Vec<LoopDevice>,
}

impl StandinSetup {
    /// Creates the nodes and the topology in `dir` and starts `daemon_bin` there, waiting
    /// until it answers.
    pub fn start(dir: &Path, gpus: &[FakeGpu], daemon_bin: &Path) -> Result<StandinSetup, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let mut loops = Vec::new();
        let mut names = vec![standin::KFD_NODE.to_owned()];
        names.extend(
            gpus.iter()
                .map(|g| standin::render_node_name(g.render_minor)),
        );
        for name in &names {
            let l = LoopDevice::attach(&dir.join(format!("{name}.store")))?;
            make_block_node(&dir.join(name), l.rdev).map_err(|e| format!("mknod {name}: {e}"))?;
            loops.push(l);
        }
        write_topology(&dir.join(standin::TOPOLOGY), gpus).map_err(|e| format!("topology: {e}"))?;
        let log = std::fs::File::create(dir.join("fake-kfd.log")).map_err(|e| e.to_string())?;
        let child = Command::new(daemon_bin)
            .arg("--dir")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", daemon_bin.display()))?;
        let mut s = StandinSetup {
            dir: dir.to_owned(),
            gpus: gpus.to_vec(),
            daemon: Some(child),
            loops,
        };
        let t0 = Instant::now();
        while s
            .kfd()
            .call(request::STATUS, 0, &0u32.to_le_bytes(), &[])
            .is_err()
        {
            if t0.elapsed() > Duration::from_secs(10) {
                s.stop();
                return Err("the stand-in KFD daemon did not come up in 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(s)
    }

    pub fn kfd(&self) -> StandinKfd {
        StandinKfd::new(&self.dir)
    }

    /// The KFD processes the daemon knows (alive ones), optionally of one pid, as JSON.
    pub fn status(&self, pid: u32) -> serde_json::Value {
        let (reply, _) = self
            .kfd()
            .call(request::STATUS, 0, &pid.to_le_bytes(), &[])
            .unwrap_or_else(|e| panic!("stand-in KFD status: {e}"));
        serde_json::from_slice(&reply).expect("status is JSON")
    }

    /// The one KFD process of `pid` (panics unless exactly one is alive).
    pub fn process(&self, pid: u32) -> serde_json::Value {
        let v = self.status(pid);
        let list = v["processes"].as_array().expect("processes");
        assert_eq!(list.len(), 1, "KFD processes of pid {pid}: {v}");
        list[0].clone()
    }

    /// Makes the next `count` CRIU ops `op` (a `KfdCriuOp` value) fail with `errno`.
    pub fn inject(&self, op: u32, errno: i32, count: u32) {
        let mut p = op.to_le_bytes().to_vec();
        p.extend_from_slice(&errno.to_le_bytes());
        p.extend_from_slice(&count.to_le_bytes());
        self.kfd()
            .call(request::INJECT, 0, &p, &[])
            .unwrap_or_else(|e| panic!("stand-in KFD inject: {e}"));
    }

    /// From now on, hand out dma-bufs that cannot be mapped (or normal ones again).
    pub fn unmappable_dmabufs(&self, on: bool) {
        self.kfd()
            .call(
                request::UNMAPPABLE_DMABUFS,
                0,
                &u32::from(on).to_le_bytes(),
                &[],
            )
            .unwrap_or_else(|e| panic!("stand-in KFD: {e}"));
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("fake-kfd.log")).unwrap_or_default()
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.loops.clear();
    }
}

impl Drop for StandinSetup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- stand-in KFD log ---\n{}", self.log());
        }
        self.stop();
    }
}
