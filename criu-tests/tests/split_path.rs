//! The split path end to end with a real CRIU: `fakegpu-vmm` on the stand-in driver
//! `libfakecudadev.so` with the gpusnap agent preloaded (its device memory is host memory, its
//! allocations real VMM mappings), CRIU with the plugin and the checkpoint-API stand-in
//! `libfakecuda.so` (`GPUSNAP_LIBCUDA`), both sides sharing `FAKECUDA_DIR`.
//!
//! - dump + restore: the data goes through the agent into gpusnap's files, the memory is
//!   released before CRIU dumps the process, and comes back at the same addresses on restore;
//!   again with a 2-slot ring of 1 MiB and zstd; with two processes, their own VMM memory and
//!   helper threads, three times in a row;
//! - `dump -R`: the plugin's rollback reloads the released memory and the process runs on;
//! - a damaged data file: the restore is refused, naming the chunk, and nothing runs (also
//!   with `verify_before_restore = false`);
//! - `durable = true`: the dump fsyncs gpusnap's files and the image directory, and a failed
//!   fsync fails it (the process runs on); its image cut short afterwards (a data file, the
//!   manifest, the manifest's rename lost) is refused at restore, naming the file, and nothing
//!   runs;
//! - `mode = transparent`: CRIU dumps the device memory itself;
//! - faults injected into the workload's driver (`inject.rs`): a copy failing or hanging in the
//!   agent during the dump (fallback to the driver path), hanging or `cuMemCreate` failing
//!   during the restore (the restore fails, nothing runs), criu killed mid-dump (`gpusnap
//!   recover`), and a release or a rollback failing part-way (no data lost, nothing runs
//!   without its memory).
//!
//! The workload checks its device memory every tick and counts in it, so a lost, stale or
//! misplaced byte shows as `ok 0` or a counter that does not follow the tick.
//!
//! Root and CRIU are needed, as for `criu-tests` (whose harness this uses);
//! `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::thread::sleep;
use std::time::{Duration, Instant};

use common::split::{AtDump, Split};
use criu_tests::fixtures::output_text;
use criu_tests::{CriuRun, procs};

impl Split {
    /// Starts `fakegpu-vmm` with `procs` processes and `args` after the defaults.
    /// These tests cover the copy-first route (`handover = false`): the hand-over has its
    /// own (`tests/handover.rs`, and its cells of the fail-closed matrix).
    fn start_with(test: &str, procs: usize, args: &[&str]) -> Option<Split> {
        let mut all = vec!["--seed", "11", "--allocs", "3", "--mib", "4"];
        all.extend_from_slice(args);
        Split::launch(test, procs, &all, &[("GPUSNAP_HANDOVER", "0")])
    }

    fn start(test: &str) -> Option<Split> {
        Split::start_with(test, 1, &[])
    }

    /// gpusnap's data files of `pid` in the image dir.
    fn data_files_of(&self, pid: i32) -> Vec<PathBuf> {
        let prefix = format!("gpusnap-{pid}-data-");
        let mut v: Vec<PathBuf> = self
            .w
            .image_files()
            .into_iter()
            .filter(|f| f.starts_with(&prefix) && f.ends_with(".img"))
            .map(|f| self.w.images.join(f))
            .collect();
        v.sort();
        v
    }

    /// gpusnap's data files of the root process.
    fn data_files(&self) -> Vec<PathBuf> {
        self.data_files_of(self.vmm.pid())
    }

    fn assert_images(&self, dump: &CriuRun) {
        for &pid in &self.vmm.pids {
            let manifest = format!("gpusnap-{pid}-manifest.img");
            assert!(
                self.w.images.join(&manifest).is_file() && !self.data_files_of(pid).is_empty(),
                "no {manifest} or data files: {:?}\n{}",
                self.w.image_files(),
                self.describe(dump)
            );
        }
        // The converted memory and the processes' own VMM memory were released before CRIU
        // dumped the processes: none of it is in CRIU's images as memfd contents.
        let memfds = fs::read(self.w.images.join("memfd.img")).unwrap_or_default();
        let dumped = self.dumped_device_memfds();
        let own = 0;
        assert!(
            !memfds.windows(15).any(|w| w == b"gpusnap-staging"),
            "CRIU dumped the staging ring (memfd.img)\n{}",
            self.describe(dump)
        );
        assert_eq!(
            dumped,
            own,
            "CRIU dumped {dumped} device memory memfds (memfd.img)\n{}",
            self.describe(dump)
        );
        let out = std::process::Command::new(&self.cli)
            .arg("verify")
            .arg(&self.w.images)
            .output()
            .expect("run gpusnap verify");
        assert!(
            out.status.success(),
            "gpusnap verify {} failed ({}):\n{}{}",
            self.w.images.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The dump's manifest of the (first) workload process.
    fn manifest(&self) -> gpusnap_image::Manifest {
        let dir = fs::File::open(&self.w.images).expect("open image dir");
        gpusnap_image::read_manifest(
            std::os::fd::AsFd::as_fd(&dir),
            gpusnap_proto::pid::NsPid(self.vmm.pid() as u32),
        )
        .expect("the dump's manifest")
    }

    /// Writes `m` as its process's manifest, sealed again with a valid checksum but without the
    /// checks a dump makes (as someone who can write the image directory could).
    fn reseal(&self, m: &gpusnap_image::Manifest) {
        let path = self
            .w
            .images
            .join(format!("gpusnap-{}-manifest.img", m.nspid));
        fs::write(path, gpusnap_image::encode_manifest_unchecked(m)).expect("write the manifest");
    }

    /// How many device-memory memfds (the stand-in's physical memory) CRIU dumped.
    fn dumped_device_memfds(&self) -> usize {
        let memfds = fs::read(self.w.images.join("memfd.img")).unwrap_or_default();
        memfds.windows(12).filter(|w| w == b"fakecuda-dev").count()
    }

    /// The dump took the split path for every process: the agent's data went into gpusnap's
    /// files and its memory was released before CRIU dumped the process.
    /// The memory a process maps with its own VMM calls (`--app-vmm`) moves too: the agent
    /// gave the process its own handle values and holds the driver's.
    fn assert_split_dump(&self, dump: &CriuRun) {
        let released = format!(
            "agent released {} allocations",
            4 + usize::from(self.app_vmm)
        );
        for pid in &self.vmm.pids {
            let p = format!("pid {pid} ");
            let q = format!("pid {pid}: ");
            self.assert_line(dump, &[&p, "path split"]);
            self.assert_line(dump, &[&q, "data", "into", "files"]);
            self.assert_line(dump, &[&q, &released]);
        }
        self.assert_images(dump);
    }

    /// `dump -R` (the workload runs on), then dump + restore (it runs on from the dump); each
    /// dump is checked with `check_dump`, the restore as a split restore.
    fn leave_running_then_restore(&mut self, check_dump: fn(&Split, &CriuRun)) {
        let dump = self.dump(true);
        self.assert_ok(&dump);
        check_dump(self, &dump);
        self.assert_runs_on(&self.vmm.last_ticks(), &dump);
        self.clear_images();
        let dump = self.dump(false);
        self.assert_ok(&dump);
        check_dump(self, &dump);
        let last = self.reap_dumped();
        let restore = self.restore();
        self.assert_ok(&restore);
        self.assert_split_restore(&restore);
        self.assert_runs_on(&last, &restore);
    }

    /// A split dump (the workload is killed), then `fault` armed in the restored agent's driver
    /// and a restore with `config`: the restore fails with a line holding every part of `why`,
    /// and nothing of the workload runs.
    fn restore_fails_after_a_dump(&mut self, fault: &str, config: &[(&str, &str)], why: &[&str]) {
        let dump = self.dump(false);
        self.assert_ok(&dump);
        self.assert_split_dump(&dump);
        let last = self.reap_dumped();
        self.inject(fault);
        let restore = self.restore_with(config);
        assert!(
            !restore.status.success(),
            "the restore succeeded despite `{fault}`\n{}",
            self.describe(&restore)
        );
        self.assert_line(&restore, why);
        self.assert_nothing_runs(&last, &restore);
    }

    /// The restore took the split path for every process and loaded data, which the GPU (the
    /// stand-in's play of the agent's kernel) checked against the dump's device hashes: every
    /// chunk has one, so there was no host checksum pass.
    fn assert_split_restore(&self, restore: &CriuRun) {
        for pid in &self.vmm.pids {
            let p = format!("pid {pid} ");
            self.assert_line(restore, &[&p, "restored (Split path)", "data"]);
            let checked = restore
                .gpusnap_lines()
                .iter()
                .filter(|l| l.contains(&p) && l.contains("restored (Split path)"))
                .filter_map(|l| {
                    let before = l.split(" chunks checked there").next()?;
                    before.rsplit(' ').next()?.parse::<u64>().ok()
                })
                .next();
            assert!(
                checked.is_some_and(|n| n > 0),
                "pid {pid}: no chunk checked on the device after loading ({checked:?})\n{}",
                self.describe(restore)
            );
        }
        self.assert_line(
            restore,
            &["every chunk has a device hash", "no host checksum pass"],
        );
        let post_forking = self.w.harness().criu_version >= (4, 2, 0);
        let warmed = restore.log.contains("cuInit ran beside CRIU's restore");
        assert_eq!(
            warmed,
            post_forking,
            "cuInit beside CRIU's restore: {warmed}, CRIU has POST_FORKING: {post_forking}\n{}",
            self.describe(restore)
        );
    }
}

/// Dump (the workload is killed) and restore: the data comes back through the agent at the
/// same addresses, and the workload counts on from where it was.
#[test]
fn split_dump_and_restore() {
    let Some(mut s) = Split::start("split-dump-restore") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    // The ring was made at PAUSE, while the workload still ran, not in its pause.
    s.assert_line(&dump, &["staging ring made while the process ran"]);
    // Every stored chunk was hashed on the GPU only: written as `raw_sum64`.
    let m = s.manifest();
    assert!(
        m.chunks
            .iter()
            .filter(|c| c.is_stored())
            .all(|c| c.codec == gpusnap_image::Codec::RawSum64 && c.content_xxh128.is_none()),
        "{:?}",
        m.chunks
    );
    let last = s.reap_dumped();

    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_split_restore(&restore);
    s.assert_runs_on(&last, &restore);
    // The restore adds its timings to the dump's stats (while CRIU's image dir is open).
    let text = fs::read_to_string(s.w.images.join("gpusnap-stats.json")).expect("stats file");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("stats JSON");
    let p = &doc["restore"]["processes"][0];
    assert!(
        p["path"] == "split" && p["timings_s"]["data"].as_f64().is_some(),
        "no restore timings in gpusnap-stats.json: {text}\n{}",
        s.describe(&restore)
    );
}

/// `dump -R`: the memory the agent released is reloaded by the rollback and the workload
/// never stops counting.
#[test]
fn split_dump_leave_running_rolls_back() {
    let Some(mut s) = Split::start("split-dump-R") else {
        return;
    };
    let dump = s.dump(true);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    s.assert_line(&dump, &["device data reloaded"]);
    assert!(s.vmm.original_running(), "{}", s.describe(&dump));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
}

/// Dumps the workload (killing it) and flips one payload byte of the first chunk of its first
/// data file; returns the file's name and the last tick.
fn dump_and_damage(s: &mut Split) -> (String, Vec<u64>) {
    let dump = s.dump(false);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    let last = s.reap_dumped();
    // The first chunk's stored bytes start after the 64-byte file header and its 64-byte
    // record header (docs/image-format.md).
    let file = s.data_files().into_iter().next().expect("a data file");
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .expect("open data file");
    let at = 64 + 64 + 1000;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).expect("read payload byte");
    b[0] ^= 0x40;
    f.write_all_at(&b, at).expect("write payload byte");
    let name = file.file_name().and_then(|n| n.to_str()).expect("name");
    (name.to_owned(), last)
}

/// One flipped payload byte in a data file. With device hashes (`verify_before_restore =
/// "auto"`) there is no host pass and the readers do not hash what the GPU will: the GPU's
/// check after loading finds the chunk, the restore fails naming its address, and nothing runs.
/// With the host's checks forced, the chunk's stored checksum does not match as it is read,
/// naming the file. (`damaged_data_found_by_the_host_pass` covers the pass before the load.)
#[test]
fn damaged_data_is_refused() {
    let Some(mut s) = Split::start("split-damaged") else {
        return;
    };
    let (name, last) = dump_and_damage(&mut s);
    let at_dump = AtDump::of(&s);
    let restore = s.restore();
    assert!(
        !restore.status.success(),
        "the restore of a damaged image succeeded\n{}",
        s.describe(&restore)
    );
    s.assert_line(&restore, &["chunk at 0x", "on the GPU after loading"]);
    s.assert_nothing_runs(&last, &restore);
    // The killed process wrote to its output before its GPU data failed the check.
    at_dump.put_back(&s);
    let restore = s.restore_in(
        "restore-host.log",
        &[("GPUSNAP_VERIFY_BEFORE_RESTORE", "host")],
    );
    assert!(!restore.status.success(), "{}", s.describe(&restore));
    s.assert_line(&restore, &[&name, "chunk", "checksum mismatch"]);
    s.assert_nothing_runs(&last, &restore);
}

/// The GPU cannot run its check after loading (its kernel launch fails in the restored
/// process), and no host pass ran (`"auto"`), so the readers skipped the host checksum of those
/// chunks: the image is then checked on the host before anything runs. A damaged image fails
/// the restore there, naming the file, and nothing runs; the intact image restores and runs on
/// bit-exact, with a warning.
#[test]
fn chunks_the_gpu_could_not_check_are_checked_on_the_host() {
    let Some(mut s) = Split::start("split-gpu-unchecked") else {
        return;
    };
    let (name, last) = dump_and_damage(&mut s);
    let at_dump = AtDump::of(&s);
    s.inject("fail cuLaunchKernel");
    let restore = s.restore();
    assert!(!restore.status.success(), "{}", s.describe(&restore));
    s.assert_line(&restore, &[&name, "chunk", "checksum mismatch"]);
    s.assert_nothing_runs(&last, &restore);

    // Mend the byte dump_and_damage flipped, and put the workload's output back as the dump
    // left it (the killed process wrote to it).
    let file = s.w.images.join(&name);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .expect("open data file");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 64 + 64 + 1000).expect("read");
    b[0] ^= 0x40;
    f.write_all_at(&b, 64 + 64 + 1000).expect("write");
    at_dump.put_back(&s);
    let restore = s.restore_in("restore-intact.log", &[]);
    s.assert_ok(&restore);
    s.assert_line(
        &restore,
        &[
            "the GPU checked only 0 of the",
            "checked on the host instead",
        ],
    );
    s.assert_runs_on(&last, &restore);
}

/// An image without device hashes (the GPU could not run the hash kernel at the dump, so the
/// chunks are raw with XXH3 checksums), damaged: with nothing for the GPU to check, the restore
/// runs the host checksum pass (`verify_before_restore = "auto"`), which refuses the damaged
/// chunk before anything is restored or the GPU touched, naming the file and the chunk.
/// (`"host"` forces the pass: `incremental.rs`.)
#[test]
fn damaged_data_found_by_the_host_pass() {
    let Some(mut s) = Split::start("split-damaged-hostpass") else {
        return;
    };
    s.inject("fail cuLaunchKernel");
    let (name, last) = dump_and_damage(&mut s);
    let m = s.manifest();
    assert!(
        m.chunks
            .iter()
            .all(|c| c.device_hash.is_none() && c.codec == gpusnap_image::Codec::Raw),
        "the dump hashed on the GPU although its kernel failed"
    );
    let restore = s.restore();
    assert!(!restore.status.success(), "{}", s.describe(&restore));
    s.assert_line(
        &restore,
        &["restore refused", &name, "chunk", "checksum mismatch"],
    );
    s.assert_nothing_runs(&last, &restore);
}

/// A chunk whose bytes are intact but whose device hash in the manifest differs (the manifest
/// sealed again): only the GPU's check after loading can tell. The restore fails naming the
/// chunk's address, and nothing runs.
#[test]
fn a_device_hash_mismatch_fails_the_restore() {
    let Some(mut s) = Split::start("split-devhash-mismatch") else {
        return;
    };
    // Compressed, so the device hash is not also the chunk's stored checksum (as it is for a
    // `raw_sum64` chunk, where changing one changes the other).
    let dump = s.dump_with(false, &[("GPUSNAP_COMPRESS", "zstd")]);
    s.assert_ok(&dump);
    let last = s.reap_dumped();
    let mut m = s.manifest();
    let c = m
        .chunks
        .iter_mut()
        .find(|c| c.is_stored() && c.codec != gpusnap_image::Codec::RawSum64)
        .expect("a stored chunk with a checksum of its own");
    c.device_hash = c.device_hash.map(|h| h ^ 1);
    let addr = c.addr;
    s.reseal(&m);
    let restore = s.restore();
    assert!(!restore.status.success(), "{}", s.describe(&restore));
    s.assert_line(
        &restore,
        &[&format!("{addr:#x}"), "on the GPU after loading"],
    );
    s.assert_nothing_runs(&last, &restore);
}

/// Memory the workload never wrote is all zero on the device: the dump records those chunks
/// as zero (no bytes in any file), the data files hold less than the device memory, and the
/// restore fills them on the device and runs on bit-exact.
#[test]
fn zero_chunks_are_recorded_not_copied() {
    let Some(mut s) = Split::start("split-zero-chunks") else {
        return;
    };
    // 1 MiB chunks: the workload leaves whole MiBs of its allocations unwritten.
    let dump = s.dump_with(false, &[("GPUSNAP_STAGING_SLOT_MIB", "1")]);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    let m = s.manifest();
    let zero: u64 = m
        .chunks
        .iter()
        .filter(|c| !c.is_stored())
        .map(|c| c.len)
        .sum();
    let moved: u64 = m.chunks.iter().map(|c| c.len).sum();
    let files: u64 = m.files.iter().map(|f| f.size).sum();
    assert!(zero > 0, "no zero chunk recorded\n{}", s.describe(&dump));
    assert!(
        files < moved - zero + (1 << 20),
        "data files hold {files} bytes for {moved} bytes of which {zero} are zero"
    );
    s.assert_line(&dump, &["hashed on the GPU", "all zero", "not copied"]);
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_split_restore(&restore);
    s.assert_line(&restore, &["zero chunks filled on the GPU"]);
    s.assert_runs_on(&last, &restore);
}

/// The manifest rewritten and sealed again (valid checksum) to claim the transparent path, and
/// the data files removed: the image is intact as far as checksums go, but the restored agent
/// reports its memory released. The restore is refused before anything is restored, and
/// nothing runs (without the cross-check the job would run on missing memory).
#[test]
fn resealed_manifest_without_the_data_is_refused() {
    let Some(mut s) = Split::start("split-resealed") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    let last = s.reap_dumped();
    let m = s.manifest();
    let forged = gpusnap_image::Manifest {
        path: gpusnap_image::CheckpointPath::Transparent,
        allocations: vec![],
        files: vec![],
        chunks: vec![],
        ..m
    };
    let dir = fs::File::open(&s.w.images).expect("open image dir");
    gpusnap_image::write_manifest(std::os::fd::AsFd::as_fd(&dir), &forged)
        .expect("seal the forged manifest");
    for f in s.data_files() {
        fs::remove_file(&f).expect("remove a data file");
    }
    let restore = s.restore();
    assert!(
        !restore.status.success(),
        "the restore of a forged image succeeded\n{}",
        s.describe(&restore)
    );
    s.assert_line(
        &restore,
        &["does not match the process", "reports its memory released"],
    );
    s.assert_nothing_runs(&last, &restore);
}

/// Another client holds a connection to the agent without using it while CRIU dumps: the agent
/// drops it once it idles, the plugin's own connection is served, and the dump takes the split
/// path and restores bit-exact (it used to fail on CRIU's "closed in-flight socket").
#[test]
fn an_idle_client_of_the_agent_does_not_break_a_dump() {
    let Some(mut s) = Split::start("split-idle-client") else {
        return;
    };
    let idle = gpusnap_proto::connect_agent(gpusnap_proto::pid::HostPid(s.vmm.pid()))
        .expect("connect as an idle client");
    let dump = s.dump(false);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    drop(idle);
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}

/// The unix sockets of `pid` that have a name (abstract or a path), as `/proc/<pid>/net/unix`
/// lists them: a name is what another user could take before a restore.
fn named_sockets_of(pid: i32) -> Vec<String> {
    let inodes: Vec<String> = fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's fds")
        .flatten()
        .filter_map(|e| fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let table = fs::read_to_string(format!("/proc/{pid}/net/unix")).expect("net/unix");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() >= 8 && inodes.iter().any(|i| i == f[6])).then(|| f[7..].join(" "))
        })
        .collect()
}

/// Binds `name` (an abstract unix name) as uid/gid 65534 in a forked child that then waits to
/// be killed; returns the child's pid once the name is taken.
fn squat_as_nobody(name: &[u8]) -> i32 {
    let mut pipe = [0i32; 2];
    // SAFETY: pipe writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    // SAFETY: the child only makes raw syscalls (no allocation) and never returns.
    let child = unsafe { libc::fork() };
    if child == 0 {
        // SAFETY: raw syscalls on valid arguments; _exit on any failure.
        unsafe {
            let mut addr: libc::sockaddr_un = std::mem::zeroed();
            addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (d, s) in addr.sun_path.iter_mut().zip(name) {
                *d = *s as libc::c_char;
            }
            let len = (std::mem::offset_of!(libc::sockaddr_un, sun_path) + name.len()) as u32;
            let ok = libc::setgroups(0, std::ptr::null()) == 0
                && libc::setresgid(65534, 65534, 65534) == 0
                && libc::setresuid(65534, 65534, 65534) == 0;
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0);
            if !ok || fd < 0 || libc::bind(fd, (&raw const addr).cast(), len) != 0 {
                libc::_exit(1);
            }
            libc::listen(fd, 1);
            libc::write(pipe[1], b"k".as_ptr().cast(), 1);
            loop {
                libc::pause();
            }
        }
    }
    assert!(child > 0);
    // SAFETY: closing our copy of the write end; then reading one byte from the read end.
    unsafe { libc::close(pipe[1]) };
    let mut byte = 0u8;
    // SAFETY: reading one byte into `byte`.
    let n = unsafe { libc::read(pipe[0], (&raw mut byte).cast(), 1) };
    // SAFETY: our descriptor.
    unsafe { libc::close(pipe[0]) };
    assert_eq!(n, 1, "the squatter could not bind its name");
    child
}

/// Nothing of the agent's has a name: the process holds no named unix socket, before or after
/// a dump, so another user who binds the agent's old name (`@gpusnap-agent-<pid>`, which the
/// agent listened on until 2026-12) after the dump cannot deny the restore (it used to fail
/// with `EADDRINUSE`, CRIU re-creating the listener).
#[test]
fn another_user_cannot_block_a_restore_by_taking_a_name() {
    let Some(mut s) = Split::start("split-squat") else {
        return;
    };
    let pid = s.vmm.pid();
    assert_eq!(named_sockets_of(pid), Vec::<String>::new());
    let dump = s.dump(false);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    let last = s.reap_dumped();
    let squatter = squat_as_nobody(format!("\0gpusnap-agent-{pid}").as_bytes());
    let restore = s.restore();
    // SAFETY: killing and reaping our own forked child.
    unsafe {
        libc::kill(squatter, libc::SIGKILL);
        libc::waitpid(squatter, std::ptr::null_mut(), 0);
    }
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
    assert_eq!(named_sockets_of(pid), Vec::<String>::new());
}

/// A client outside a checkpoint (root, here) asks the agent of a running workload to release
/// its memory after a full copy, and to load data into it: both are refused, the connection
/// says why, and the workload never notices (every tick stays good).
#[test]
fn the_agent_releases_and_loads_only_while_the_process_is_held() {
    use gpusnap_cuda::agent::{AgentError, AgentSession, RingShape, Transfer};
    use gpusnap_proto::Reply;
    let Some(s) = Split::start("split-agent-outside") else {
        return;
    };
    let pid = gpusnap_proto::pid::HostPid(s.vmm.pid());
    let wait = Duration::from_secs(10);
    let ring = gpusnap_cuda::staging::Staging::new(1 << 20, 4).expect("ring");
    let shape = RingShape {
        slot_size: 1 << 20,
        slots: 4,
        streams: 1,
    };
    // A whole copy out is harmless (the memory stays); its Release is not.
    let agent = AgentSession::connect_expected(pid, wait).expect("connect");
    agent
        .begin(Transfer::Out, std::os::fd::AsFd::as_fd(ring.fd()), shape)
        .expect("DumpBegin");
    loop {
        match agent.recv(wait).expect("a reply") {
            Reply::ChunkReady { slot, .. } => agent.slot_free(slot).expect("SlotFree"),
            Reply::ChunkZero { .. } => {}
            Reply::DumpDataDone { .. } => break,
            other => panic!("{other:?}"),
        }
    }
    match agent.release() {
        Err(AgentError::Refused { message, .. }) => {
            assert!(message.contains("threads of this process run"), "{message}")
        }
        other => panic!("Release of a running process: {other:?}"),
    }
    let agent = AgentSession::connect_expected(pid, wait).expect("connect again");
    match agent.begin(Transfer::In, std::os::fd::AsFd::as_fd(ring.fd()), shape) {
        Err(AgentError::Refused { message, .. }) => assert!(
            message.contains("threads of this process run")
                || message.contains("nothing is released"),
            "{message}"
        ),
        other => panic!("RestoreBegin on live memory: {other:?}"),
    }
    let last = s.vmm.last_ticks();
    let logs = s.vmm.wait_for_tick(last[0] + common::MORE_TICKS);
    logs[0]
        .check()
        .unwrap_or_else(|e| panic!("the workload noticed: {e}"));
}

/// The same with `verify_before_restore = false`: the damage is found when the chunk is read
/// for loading, and the restore fails; the damaged bytes never reach the workload.
#[test]
fn damaged_data_without_verification_fails_the_restore() {
    let Some(mut s) = Split::start("split-damaged-noverify") else {
        return;
    };
    let (name, last) = dump_and_damage(&mut s);
    let restore = s.restore_with(&[("GPUSNAP_VERIFY_BEFORE_RESTORE", "false")]);
    assert!(
        !restore.status.success(),
        "the restore of a damaged image succeeded\n{}",
        s.describe(&restore)
    );
    s.assert_line(&restore, &[&name, "checksum mismatch"]);
    s.assert_nothing_runs(&last, &restore);
}

/// What a crash left of one image file.
enum Cut {
    /// Its last bytes lost.
    Tail(u64),
    /// Only its first half there.
    Half,
    /// Not there at all (its rename did not reach the disk).
    Gone,
}

/// Does `cut` to `path`; returns the file's bytes before.
fn cut_short(path: &std::path::Path, cut: &Cut) -> Vec<u8> {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let len = bytes.len() as u64;
    let len = match cut {
        Cut::Tail(lost) => len - lost,
        Cut::Half => len / 2,
        Cut::Gone => {
            fs::remove_file(path).expect("remove image file");
            return bytes;
        }
    };
    let f = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open image file");
    f.set_len(len).expect("cut image file");
    bytes
}

/// A durable dump, then its image cut short as a crash before the page cache reached the disk
/// could leave it: the last page of a data file lost, the manifest cut in half, the manifest
/// gone (its rename lost) with the data files there. Each time `gpusnap verify` fails naming
/// the file, and the restore is refused before CRIU restores anything, naming it, and nothing
/// runs; put back whole, the image restores and the workload counts on.
#[test]
fn image_cut_short_is_refused() {
    let Some(mut s) = Split::start("split-cut-short") else {
        return;
    };
    let dump = s.dump_with(false, &[("GPUSNAP_DURABLE", "1")]);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    s.assert_line(&dump, &["durable: ", "image directory fsynced"]);
    let last = s.reap_dumped();
    let pid = s.vmm.pid();
    let data = s.data_files().into_iter().next().expect("a data file");
    let manifest = s.w.images.join(format!("gpusnap-{pid}-manifest.img"));
    let name = |p: &std::path::Path| p.file_name().unwrap().to_str().unwrap().to_owned();
    let (data_name, manifest_name) = (name(&data), name(&manifest));
    let no_manifest = format!("has no {manifest_name}: its dump did not finish");
    let cases = [
        (
            &data,
            Cut::Tail(4096),
            vec![data_name.as_str(), "truncated"],
        ),
        (
            &manifest,
            Cut::Half,
            vec![manifest_name.as_str(), "truncated"],
        ),
        (&manifest, Cut::Gone, vec![no_manifest.as_str()]),
    ];
    for (i, (path, cut, why)) in cases.iter().enumerate() {
        let whole = cut_short(path, cut);
        let out = std::process::Command::new(&s.cli)
            .arg("verify")
            .arg(&s.w.images)
            .output()
            .expect("run gpusnap verify");
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success() && why.iter().all(|w| said.contains(w)),
            "case {i}: gpusnap verify ({}) does not fail with {why:?}:\n{said}",
            out.status
        );
        let restore = s.restore_in(&format!("restore-cut-{i}.log"), &[]);
        assert!(
            !restore.status.success(),
            "case {i}: the restore of an image cut short succeeded\n{}",
            s.describe(&restore)
        );
        let mut needles = vec!["restore refused"];
        needles.extend(why);
        s.assert_line(&restore, &needles);
        s.assert_nothing_runs(&last, &restore);
        fs::write(path, whole).expect("put the file back");
    }
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_split_restore(&restore);
    s.assert_runs_on(&last, &restore);
}

/// `durable = true` and the fsync of the image directory fails (`GPUSNAP_TEST_FAIL_SYNC=1`
/// reports EIO): the dump fails, saying why, although its memory was already released; the
/// rollback reloads it from the files, the workload counts on, and gpusnap's files are removed.
#[test]
fn failed_fsync_fails_a_durable_dump() {
    let Some(mut s) = Split::start("split-durable-fsync-fails") else {
        return;
    };
    let config = [("GPUSNAP_DURABLE", "1"), ("GPUSNAP_TEST_FAIL_SYNC", "1")];
    let dump = s.dump_with(false, &config);
    assert!(
        !dump.succeeded(),
        "the dump succeeded although its fsync failed\n{}",
        s.describe(&dump)
    );
    s.assert_line(
        &dump,
        &["durable = true: image directory: fsync failed", "refused"],
    );
    s.assert_line(&dump, &["device data reloaded"]);
    assert!(s.vmm.original_running(), "{}", s.describe(&dump));
    s.assert_runs_on(&s.vmm.last_ticks(), &dump);
    let left: Vec<String> =
        s.w.image_files()
            .into_iter()
            .filter(|f| f.starts_with("gpusnap-"))
            .collect();
    assert!(left.is_empty(), "gpusnap files left: {left:?}");
}

/// A driver copy fails in the agent part-way through the copy-out: nothing was released yet,
/// so the plugin falls back to the driver checkpoint; the agent unmapped its staging ring before
/// answering, so CRIU does not dump it, and the restored workload runs on.
#[test]
fn copy_out_error_falls_back_to_the_driver_path() {
    let Some(mut s) = Split::start("split-copy-fails") else {
        return;
    };
    s.inject("fail cuMemcpyDtoHAsync_v2 after 2");
    let dump = s.dump(false);
    s.assert_ok(&dump);
    s.assert_line(&dump, &["split path failed before any memory was released"]);
    assert!(s.data_files().is_empty(), "{:?}", s.w.image_files());
    let memfds = fs::read(s.w.images.join("memfd.img")).unwrap_or_default();
    assert!(
        !memfds.windows(15).any(|w| w == b"gpusnap-staging"),
        "CRIU dumped the staging ring with the process\n{}",
        s.describe(&dump)
    );
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}

/// A small staging ring (2 slots of 1 MiB: every allocation is several chunks, slots are reused
/// many times in both directions) and zstd (one allocation is half zeros).
#[test]
fn split_small_ring_and_zstd() {
    let Some(mut s) = Split::start("split-small-ring") else {
        return;
    };
    let config = [
        ("GPUSNAP_STAGING_SLOT_MIB", "1"),
        ("GPUSNAP_STAGING_SLOTS", "2"),
        ("GPUSNAP_COPY_STREAMS", "2"),
        ("GPUSNAP_COMPRESS", "zstd"),
    ];
    let dump = s.dump_with(false, &config);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    // 4 + 4 + 6 (the odd size, rounded to the granularity) + 2 MiB, in 1 MiB chunks.
    s.assert_line(&dump, &["16 chunks"]);
    let stored: u64 = s
        .data_files()
        .iter()
        .map(|f| fs::metadata(f).map_or(0, |m| m.len()))
        .sum();
    assert!(
        stored < 15 << 20,
        "zstd stored {stored} bytes: nothing was compressed\n{}",
        s.describe(&dump)
    );
    let last = s.reap_dumped();
    let restore = s.restore_with(&config);
    s.assert_ok(&restore);
    s.assert_split_restore(&restore);
    s.assert_runs_on(&last, &restore);
}

/// `mode = transparent` with the agent loaded: the plugin leaves the agent alone, CRIU dumps the
/// device memory itself (the stand-in's memfd mappings) and the restore brings it back.
#[test]
fn transparent_mode_dumps_device_memory_with_criu() {
    let Some(mut s) = Split::start("transparent-mode") else {
        return;
    };
    let config = [("GPUSNAP_MODE", "transparent")];
    let dump = s.dump_with(false, &config);
    s.assert_ok(&dump);
    s.assert_line(&dump, &["path transparent"]);
    assert!(s.data_files().is_empty(), "{:?}", s.w.image_files());
    let last = s.reap_dumped();
    let restore = s.restore_with(&config);
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}

/// A dump during which the agent hangs in a driver copy (a wedged GPU), with
/// `agent_timeout_ms = 1000`; it must succeed.
fn dump_with_hung_agent(test: &str) -> Option<(Split, CriuRun)> {
    let s = Split::start(test)?;
    // Only the agent makes asynchronous copies: the workload's own calls are untouched.
    s.inject("hang cuMemcpyDtoHAsync_v2");
    let dump = s.dump_with(false, &[("GPUSNAP_AGENT_TIMEOUT_MS", "1000")]);
    s.assert_ok(&dump);
    s.assert_line(&dump, &["path split"]);
    s.assert_line(&dump, &["split path failed before any memory was released"]);
    assert!(s.data_files().is_empty(), "{:?}", s.w.image_files());
    Some((s, dump))
}

/// The agent hangs in a driver copy during the dump: the plugin gives up on the split path
/// after `agent_timeout_ms`, before anything was released, and falls back to the driver
/// checkpoint; the dump succeeds and the restored workload runs on.
#[test]
fn hung_agent_falls_back_to_the_driver_path() {
    let Some((mut s, _)) = dump_with_hung_agent("split-hung-agent") else {
        return;
    };
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}

/// After that fallback, the staging ring the plugin handed the hung agent may still be mapped
/// in the process (the agent never got to unmap it). The plugin truncates the ring's memfd when
/// the agent does not confirm the abort, so CRIU dumps an empty mapping instead of the whole
/// ring (`staging_slot_mib * staging_slots`, 512 MiB by default) as process memory.
#[test]
fn hung_agent_fallback_does_not_dump_the_ring() {
    let Some((s, dump)) = dump_with_hung_agent("split-hung-staging") else {
        return;
    };
    let pages: u64 = fs::read_dir(&s.w.images)
        .expect("image dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    assert!(
        pages < 128 << 20,
        "CRIU dumped {pages} bytes of pages: the 512 MiB staging ring went into the image\n{}",
        s.describe(&dump)
    );
}

/// State the driver cannot checkpoint (managed memory, a CUDA IPC handle the driver made, peer
/// access, another process's interprocess event opened here), which the agent records as it
/// happens: the dump is refused at PAUSE with the cause named, before the process is locked, and
/// the process runs on untraced. (An IPC handle the agent served is carried:
/// `ipc_checkpoint.rs`.)
#[test]
fn unsupported_state_is_refused_before_the_process_is_touched() {
    for (kind, cause) in [
        ("managed", "managed (unified) memory"),
        ("ipc-driver", "CUDA IPC"),
        ("peer", "peer access"),
        (
            "ipc-event",
            "an interprocess CUDA event of another process opened here (cuIpcOpenEventHandle)",
        ),
    ] {
        let Some(mut s) =
            Split::start_with(&format!("split-hazard-{kind}"), 1, &["--hazard", kind])
        else {
            return;
        };
        let dump = s.dump(false);
        assert!(
            !dump.succeeded(),
            "{kind}: the dump succeeded\n{}",
            s.describe(&dump)
        );
        s.assert_line(&dump, &["cannot be checkpointed", cause]);
        let calls =
            fs::read_to_string(s.state.join(format!("{}.log", s.vmm.pid()))).unwrap_or_default();
        assert!(
            !calls.lines().any(|l| l.starts_with("lock")),
            "{kind}: the process was locked before the refusal\n{calls}"
        );
        assert!(s.vmm.original_running(), "{}", s.describe(&dump));
        s.assert_runs_on(&s.vmm.last_ticks(), &dump);
    }
}

/// An interprocess event opened and destroyed again before the dump (as PyTorch does while it
/// rebuilds a received tensor) leaves nothing to refuse: the dump (`-R`) succeeds on the split
/// path and the process runs on.
#[test]
fn an_ipc_event_destroyed_before_the_dump_is_not_refused() {
    let Some(s) = Split::start_with(
        "split-ipc-event-closed",
        1,
        &["--hazard", "ipc-event-closed"],
    ) else {
        return;
    };
    let dump = s.dump(true);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    assert!(
        !dump.log.contains("interprocess CUDA event"),
        "the destroyed event was named\n{}",
        s.describe(&dump)
    );
    s.assert_runs_on(&s.vmm.last_ticks(), &dump);
}

/// Re-creating the device memory fails in the restored agent (`cuMemCreate` fails): the
/// restore fails with the driver's error named, and nothing of the workload runs.
#[test]
fn failing_device_allocation_fails_the_restore() {
    let Some(mut s) = Split::start("split-create-fails") else {
        return;
    };
    s.restore_fails_after_a_dump(
        "fail cuMemCreate",
        &[],
        &["cuMemCreate", "CUDA_ERROR_UNKNOWN"],
    );
}

/// Two GPU processes (checkpointed in parallel), each with memory it maps itself with the VMM
/// calls (its handle virtualized by the agent, so it moves like converted memory) and helper
/// threads with driver calls in flight, checkpointed three times: `dump -R`, then dump +
/// restore, then the restored processes again (their re-created memory is released and
/// re-created once more).
#[test]
fn two_processes_checkpointed_again_and_again() {
    let Some(mut s) = Split::start_with("split-again", 2, &["--app-vmm", "--threads", "2"]) else {
        return;
    };
    let dump = s.dump(true);
    s.assert_ok(&dump);
    s.assert_split_dump(&dump);
    s.assert_line(&dump, &["2 GPU processes checkpointed in parallel"]);
    assert!(
        !dump.log.contains("cannot be detected"),
        "an IPC warning although both processes have the agent\n{}",
        s.describe(&dump)
    );
    s.assert_runs_on(&s.vmm.last_ticks(), &dump);

    for round in 0..2 {
        s.clear_images();
        let dump = s.dump(false);
        s.assert_ok(&dump);
        s.assert_split_dump(&dump);
        let last = s.reap_dumped();
        let restore = s.restore();
        s.assert_ok(&restore);
        s.assert_split_restore(&restore);
        s.assert_line(&restore, &["2 GPU processes restored in parallel"]);
        s.assert_runs_on(&last, &restore);
        eprintln!("round {round} done");
    }
}

/// The process's own VMM handle keeps working across checkpoints although the memory behind it
/// is released and re-created: the workload unmaps its handle and maps it again every tick, with
/// the value `cuMemCreate` gave it before the dump, after a `dump -R` and after a restore.
#[test]
fn app_vmm_handle_values_survive_checkpoints() {
    let Some(mut s) =
        Split::start_with("split-app-vmm-remap", 1, &["--app-vmm", "--app-vmm-remap"])
    else {
        return;
    };
    s.leave_running_then_restore(moved_app_vmm);
}

/// The agent released the app-VMM mapping with the rest, or (when the dump stopped the
/// workload between its unmap and its map) left its unmapped handle to the driver.
fn moved_app_vmm(s: &Split, dump: &CriuRun) {
    let q = format!("pid {}: ", s.vmm.pid());
    let moved = dump
        .gpusnap_lines()
        .iter()
        .any(|l| l.contains(&q) && l.contains("agent released 5 allocations"));
    if !moved {
        s.assert_line(dump, &[&q, "agent released 4 allocations"]);
        eprintln!("the dump came between the workload's unmap and map");
    }
}

/// The process released its handle right after mapping it: the mapping alone holds the memory,
/// which the agent still moves (and re-creates without keeping a reference to it).
#[test]
fn released_app_vmm_handle_moves_too() {
    let Some(mut s) = Split::start_with(
        "split-app-vmm-release",
        1,
        &["--app-vmm", "--app-vmm-release"],
    ) else {
        return;
    };
    s.leave_running_then_restore(Split::assert_split_dump);
}

/// With `GPUSNAP_AGENT_APP_VMM=0` the agent only records the memory a process maps itself: the
/// split path moves the converted allocations, CRIU dumps the process's own VMM memory (the
/// driver checkpoint's copy, here a memfd), and it comes back either way.
#[test]
fn app_vmm_can_be_left_to_the_driver() {
    let Some(mut s) = Split::launch(
        "split-app-vmm-off",
        1,
        &["--seed", "11", "--allocs", "3", "--mib", "4", "--app-vmm"],
        &[("GPUSNAP_AGENT_APP_VMM", "0"), ("GPUSNAP_HANDOVER", "0")],
    ) else {
        return;
    };
    let dump = s.dump(false);
    s.assert_ok(&dump);
    let q = format!("pid {}: ", s.vmm.pid());
    s.assert_line(&dump, &[&q, "agent released 4 allocations"]);
    assert_eq!(
        s.dumped_device_memfds(),
        1,
        "CRIU should have dumped the process's own VMM memory\n{}",
        s.describe(&dump)
    );
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}

/// CRIU is killed in the middle of a split dump, after the agent released the memory (during
/// the driver checkpoint, made slow with `FAKECUDA_CALL_DELAY_MS`): the workload is left
/// locked, its driver calls held, its memory released. `gpusnap recover PID --images DIR`
/// unlocks it and reloads the data from the files the dump wrote, and it runs on intact.
#[test]
fn recover_after_criu_killed_mid_dump() {
    let Some(s) = Split::start("split-recover") else {
        return;
    };
    let log = s.w.path.join("dump.log");
    let mut args = s.w.criu_args_in("dump", &s.w.images, &log);
    args.extend(["-t".to_owned(), s.vmm.pid().to_string()]);
    let env = [
        (
            "GPUSNAP_LIBCUDA",
            s.fakecuda_so.to_str().expect("utf-8 path"),
        ),
        ("FAKECUDA_DIR", s.state.to_str().expect("utf-8 path")),
        ("FAKECUDA_CALL_DELAY_MS", "4000"),
        ("GPUSNAP_HANDOVER", "0"),
    ];
    let mut criu = s.w.spawn_criu(&args, &env, &log);
    let deadline = Instant::now() + common::WAIT;
    while !criu.log_so_far().contains("agent released") {
        assert!(
            criu.try_status().is_none() && Instant::now() < deadline,
            "criu ended or took too long before the agent released its memory:\n{}",
            criu.log_so_far()
        );
        sleep(Duration::from_millis(10));
    }
    // Into the slow driver checkpoint, then kill criu.
    sleep(Duration::from_millis(500));
    let killed = criu.kill().expect("kill criu");
    let held = s.vmm.last_ticks();
    sleep(Duration::from_millis(500));
    // Not stopped (criu's death ended the ptrace stops): held by the driver lock, in a call.
    let main = procs::stat(s.vmm.pid()).map(|st| st.state);
    assert!(
        matches!(main, Some('S' | 'R')),
        "the workload's main thread is in state {main:?}\n{}",
        s.describe(&killed)
    );
    assert_eq!(
        s.vmm.last_ticks(),
        held,
        "the workload ran on with its memory released\n{}",
        s.describe(&killed)
    );

    let out = std::process::Command::new(&s.cli)
        .arg("recover")
        .arg(s.vmm.pid().to_string())
        .arg("--images")
        .arg(&s.w.images)
        .envs(env[..2].iter().copied())
        .output()
        .expect("run gpusnap recover");
    let text = output_text(&out);
    assert!(
        out.status.success() && text.contains("device data reloaded"),
        "gpusnap recover failed ({}): {text}\n{}",
        out.status,
        s.describe(&killed)
    );
    s.assert_runs_on(&held, &killed);
}

/// The restored agent hangs copying the data in: the restore gives up after
/// `agent_timeout_ms`, fails naming the hung agent, and nothing of the workload runs.
#[test]
fn hung_agent_at_restore_fails_the_restore() {
    let Some(mut s) = Split::start("split-hung-restore") else {
        return;
    };
    s.restore_fails_after_a_dump(
        "hang cuMemcpyHtoDAsync_v2",
        &[("GPUSNAP_AGENT_TIMEOUT_MS", "1000")],
        &["GPU restore failed", "no progress"],
    );
}

/// The agent's release fails part-way: the second `cuMemUnmap` fails, after the first
/// allocation was unmapped and released. Whatever the dump then does, no data may be lost:
/// either the dump fails and the workload runs on intact (its released memory reloaded from
/// the files just written), or it succeeds and the restored workload is intact.
#[test]
fn release_failing_part_way_loses_no_data() {
    let Some(mut s) = Split::start("split-release-fails") else {
        return;
    };
    s.inject("fail cuMemUnmap after 1");
    let dump = s.dump(false);
    if dump.succeeded() {
        let last = s.reap_dumped();
        let restore = s.restore();
        s.assert_ok(&restore);
        s.assert_runs_on(&last, &restore);
    } else {
        assert!(s.vmm.original_running(), "{}", s.describe(&dump));
        s.assert_runs_on(&s.vmm.last_ticks(), &dump);
    }
}

/// `dump -R`, and the rollback cannot re-create all the memory (the second `cuMemCreate` fails):
/// the workload must not run on with memory missing or re-created empty. Held by the driver
/// lock it can be brought back with `gpusnap recover` from the files the dump wrote, which is
/// what the plugin's message advises.
#[test]
fn rollback_failing_part_way_does_not_run_without_memory() {
    let Some(s) = Split::start("split-rollback-fails") else {
        return;
    };
    s.inject("fail cuMemCreate after 1");
    let dump = s.dump(true);
    s.assert_line(&dump, &["ROLLBACK FAILED"]);
    let held = s.vmm.last_ticks();
    sleep(Duration::from_millis(500));
    let logs = s.vmm.read();
    assert!(
        logs.iter().all(|l| l.check().is_ok()) && s.vmm.last_ticks() == held,
        "the workload ran on without its memory\n{}",
        s.describe(&dump)
    );
    fs::remove_file(s.state.join(format!("{}.dev-inject", s.vmm.pid()))).expect("disarm");
    let out = std::process::Command::new(&s.cli)
        .arg("recover")
        .arg(s.vmm.pid().to_string())
        .arg("--images")
        .arg(&s.w.images)
        .env("GPUSNAP_LIBCUDA", &s.fakecuda_so)
        .env("FAKECUDA_DIR", &s.state)
        .output()
        .expect("run gpusnap recover");
    assert!(
        out.status.success(),
        "gpusnap recover failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    s.assert_runs_on(&held, &dump);
}

/// What `durable = true` costs (run by hand; prints a table): a 512 MiB split dump (4
/// allocations of 128 MiB) into an image directory on tmpfs (`/dev/shm`) and on the disk of
/// `target/`, three times each with `durable` off and on, each from a fresh workload (the dump
/// kills it). Reported: the data phase (the writers, each ending with its file's fsync when
/// durable), the manifest commit (with the directory's fsync when durable), the whole `criu
/// dump`, and a `sync -f` of the directory right after it, which is what the user must run for
/// CRIU's own files anyway.
///
/// `cargo test --release -p criu-tests --test split_path -- --ignored durable_cost --nocapture`
#[test]
#[ignore = "a measurement, run by hand"]
fn durable_cost() {
    let shm = std::path::Path::new("/dev/shm")
        .join(format!("gpusnap-durable-cost-{}", std::process::id()));
    let mut rows = Vec::new();
    for (where_, on_tmpfs) in [("tmpfs", true), ("disk", false)] {
        for durable in ["0", "1"] {
            for run in 0..3 {
                let test = format!("durable-cost-{where_}-{durable}-{run}");
                let Some(mut s) = Split::launch(
                    &test,
                    1,
                    &["--seed", "5", "--allocs", "4", "--mib", "128"],
                    &[],
                ) else {
                    return;
                };
                let dir = if on_tmpfs {
                    shm.join(&test)
                } else {
                    s.w.path.join("images-cost")
                };
                fs::create_dir_all(&dir).expect("mkdir image dir");
                sync_all();
                let pid = s.vmm.pid().to_string();
                let t0 = Instant::now();
                let dump = s.criu_at(
                    &dir,
                    "dump",
                    "dump-cost.log",
                    &["-t", &pid],
                    &[("GPUSNAP_DURABLE", durable)],
                );
                let dump_s = t0.elapsed().as_secs_f64();
                s.assert_ok(&dump);
                let t0 = Instant::now();
                let synced = std::process::Command::new("sync")
                    .arg("-f")
                    .arg(&dir)
                    .status()
                    .expect("run sync -f");
                let sync_s = t0.elapsed().as_secs_f64();
                assert!(synced.success());
                let stats: serde_json::Value = serde_json::from_str(
                    &fs::read_to_string(dir.join("gpusnap-stats.json")).expect("stats"),
                )
                .expect("stats JSON");
                let data_s = stats["processes"][0]["timings_s"]["data"]
                    .as_f64()
                    .unwrap_or(-1.0);
                let commit_s = dump
                    .gpusnap_lines()
                    .iter()
                    .find_map(|l| {
                        let rest = l.split("image directory fsynced in ").nth(1)?;
                        rest.trim_end_matches(" s").parse::<f64>().ok()
                    })
                    .unwrap_or(0.0);
                rows.push(format!(
                    "{where_:5} durable={durable} run {run}: data {data_s:.3} s, commit {commit_s:.3} s, criu dump {dump_s:.3} s, sync -f after {sync_s:.3} s"
                ));
                s.reap_dumped();
                let _ = fs::remove_dir_all(&dir);
            }
        }
    }
    let _ = fs::remove_dir_all(&shm);
    for r in rows {
        eprintln!("{r}");
    }
}

/// `sync`: nothing dirty is left from earlier work to be written during a measured dump.
fn sync_all() {
    let status = std::process::Command::new("sync")
        .status()
        .expect("run sync");
    assert!(status.success(), "sync: {status}");
}

/// The workload's driver copies take 500 ms longer while in flight (`slow`, on two helper
/// threads that copy in a loop, so one is nearly always inside a call). The lock of the dump's
/// PAUSE waits for the call in flight before it returns, as the real driver's does (the
/// stand-in's record says so), and the dump and restore go through.
#[test]
fn the_checkpoint_lock_waits_for_a_call_in_flight() {
    let Some(mut s) = start_with_copying_threads("lock-waits-in-flight") else {
        return;
    };
    let pid = s.vmm.pid();
    s.inject("slow cuMemcpyDtoH_v2");
    sleep(Duration::from_millis(100));
    let dump = s.dump(false);
    s.assert_ok(&dump);
    let calls = fs::read_to_string(s.state.join(format!("{pid}.log"))).unwrap_or_default();
    assert!(
        calls
            .lines()
            .any(|l| l.starts_with("lock rc=0") && l.contains("waited_for_calls=1")),
        "no lock waited for a call in flight:\n{calls}"
    );
    fs::remove_file(s.state.join(format!("{pid}.dev-inject"))).expect("disarm");
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}

/// The same with a lock timeout shorter than the call in flight: the lock times out (the
/// stand-in, like the driver, leaves the process running), the dump fails naming the lock,
/// and the workload runs on.
#[test]
fn a_call_in_flight_longer_than_the_lock_timeout_fails_the_dump_and_the_job_runs_on() {
    let Some(s) = start_with_copying_threads("lock-timeout-in-flight") else {
        return;
    };
    let pid = s.vmm.pid();
    s.inject("slow cuMemcpyDtoH_v2");
    sleep(Duration::from_millis(100));
    let dump = s.dump_with(false, &[("GPUSNAP_LOCK_TIMEOUT_MS", "100")]);
    assert!(!dump.succeeded(), "{}", s.describe(&dump));
    s.assert_line(
        &dump,
        &["locking the CUDA state of pid", "the process keeps running"],
    );
    fs::remove_file(s.state.join(format!("{pid}.dev-inject"))).expect("disarm");
    assert_eq!(s.driver_state(), "running", "{}", s.describe(&dump));
    s.assert_runs_on(&s.vmm.last_ticks(), &dump);
}

/// A workload with two more threads copying from the device in a loop.
fn start_with_copying_threads(test: &str) -> Option<Split> {
    Split::launch(
        test,
        1,
        &[
            "--seed",
            "13",
            "--allocs",
            "2",
            "--mib",
            "2",
            "--threads",
            "2",
        ],
        &[],
    )
}
