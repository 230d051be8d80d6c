//! The job is untrusted, the data path's part (issue 32, items 3 to 6): a job whose agent was
//! patched (the hostile test build, `gpusnap_proto::hostile`, played by `GPUSNAP_HOSTILE`)
//! cannot kill root's CRIU, nor grow its memory, its disk or its time beyond what the job
//! listed. Each test plays one attack with real CRIU on the stand-in driver, with `-R`: the
//! split path is refused at once (or the attack comes to nothing), the dump falls back to the
//! driver's checkpoint as any split-path failure before a release does, and the job runs on,
//! on its own memory.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::split::Split;
use criu_tests::CriuRun;

/// Three 4 MiB allocations and the workload's others: 16 MiB the agent lists to move
/// (4 + 4 + 6 + 2 MiB, `split_path.rs`'s `split_small_ring_and_zstd`).
const ARGS: &[&str] = &["--seed", "13", "--allocs", "3", "--mib", "4"];
const LISTED: u64 = 16 << 20;

fn copy_first(test: &str, attack: &'static str) -> Option<Split> {
    Split::hostile(test, attack, ARGS, &[("GPUSNAP_HANDOVER", "0")])
}

/// What a dump did, watched from outside.
struct Watched {
    run: CriuRun,
    /// The most bytes gpusnap's data files of the job held at once while CRIU ran.
    max_data: u64,
    took: Duration,
}

fn data_bytes(images: &Path) -> u64 {
    std::fs::read_dir(images)
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.starts_with("gpusnap-") && n.contains("-data-")
                })
                .map(|e| e.metadata().map_or(0, |m| m.len()))
                .sum()
        })
        .unwrap_or(0)
}

/// `criu dump -R` with `config`, the image directory's gpusnap data watched meanwhile.
fn dump_watched(s: &Split, config: &[(&str, &str)]) -> Watched {
    let stop = Arc::new(AtomicBool::new(false));
    let max = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (stop, max, images) = (stop.clone(), max.clone(), s.w.images.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                max.fetch_max(data_bytes(&images), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let t0 = Instant::now();
    let run = s.dump_with(true, config);
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    watcher.join().expect("the watcher thread");
    max.fetch_max(data_bytes(&s.w.images), Ordering::Relaxed);
    Watched {
        run,
        max_data: max.load(Ordering::Relaxed),
        took,
    }
}

/// CRIU lived, the split path was refused with `why` (every needle on one gpusnap line) before
/// anything was released, the driver's checkpoint took the job instead, and the job runs on.
fn assert_refused_and_job_runs_on(s: &mut Split, run: &CriuRun, why: &[&str]) {
    assert_eq!(
        run.status.signal(),
        None,
        "CRIU was killed by a signal\n{}",
        s.describe(run)
    );
    s.assert_line(run, why);
    s.assert_line(run, &["split path failed before any memory was released"]);
    s.assert_ok(run);
    assert!(s.vmm.original_running(), "{}", s.describe(run));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, run);
}

/// Item 3: the job truncates the staging memfd to 0 bytes before it announces the first chunk.
/// CRIU used to die of SIGBUS reading it (with zstd, the writers read the ring themselves; a
/// raw chunk goes to `pwrite`, where the kernel's read fails with EFAULT instead). The ring is
/// sealed against any change of size before the job gets it, so the truncation fails and the
/// dump goes on as if nothing happened.
#[test]
fn a_job_cannot_shrink_the_staging_ring_under_criu() {
    let Some(mut s) = copy_first("hostile-shrink-staging", "shrink-staging") else {
        return;
    };
    let w = dump_watched(&s, &[("GPUSNAP_COMPRESS", "zstd")]);
    let run = &w.run;
    assert_eq!(
        run.status.signal(),
        None,
        "CRIU was killed by a signal (SIGBUS: the job shrank the ring under it)\n{}",
        s.describe(run)
    );
    s.assert_ok(run);
    s.assert_line(run, &["path split"]);
    let pid = s.vmm.pid();
    assert!(
        s.w.images
            .join(format!("gpusnap-{pid}-manifest.img"))
            .is_file(),
        "a split dump without its manifest: {:?}\n{}",
        s.w.image_files(),
        s.describe(run)
    );
    assert!(s.vmm.original_running(), "{}", s.describe(run));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, run);
}

/// Item 4: 200 000 `Allocation` replies more than the job holds. They used to be kept, every
/// one (5 million: 468 MB of CRIU's memory). The listing is refused once it passes the
/// `Hello`'s count and a slack of 1024, naming the count.
#[test]
fn an_allocation_flood_is_refused_at_the_hellos_count() {
    let Some(mut s) = copy_first("hostile-alloc-flood", "alloc-flood:200000") else {
        return;
    };
    let w = dump_watched(&s, &[]);
    assert_refused_and_job_runs_on(
        &mut s,
        &w.run,
        &["sent more than", "allocations", "Hello's count"],
    );
}

/// Item 4: 200 000 `ChunkZero` replies for the first chunk. Each used to become an entry of
/// the manifest in CRIU's memory (20 million: 3.7 GB). A chunk announced twice is refused at
/// the second, naming the allocation and the range.
#[test]
fn a_zero_chunk_flood_is_refused_at_the_second() {
    let Some(mut s) = copy_first("hostile-zero-flood", "zero-flood:200000") else {
        return;
    };
    let w = dump_watched(&s, &[]);
    assert_refused_and_job_runs_on(
        &mut s,
        &w.run,
        &[
            "announced ChunkZero",
            "of allocation #",
            "already announced",
        ],
    );
    assert_eq!(w.max_data, 0, "{}", s.describe(&w.run));
}

/// Item 5: every `ChunkReady` sent 40 times. Each used to be written again (an endless stream
/// filled root's disk). A chunk announced twice is refused before it is written again: the
/// job's data files never hold more than the 16 MiB it listed.
#[test]
fn a_chunk_ready_flood_never_writes_past_the_listed_bytes() {
    let Some(mut s) = copy_first("hostile-ready-flood", "ready-flood:40") else {
        return;
    };
    let w = dump_watched(&s, &[]);
    // The data files' headers and checksums on top of the data.
    assert!(
        w.max_data <= LISTED + (1 << 20),
        "the job's data files held {} bytes, more than the {LISTED} it listed\n{}",
        w.max_data,
        s.describe(&w.run)
    );
    assert_refused_and_job_runs_on(
        &mut s,
        &w.run,
        &[
            "announced ChunkReady",
            "of allocation #",
            "already announced",
        ],
    );
}

/// Item 6, the listing: each reply comes 0.7 s late, within the 1 s agent timeout. The listing
/// used to take as long as the job liked (63.5 s seen); it now ends at its deadline, the
/// timeout plus 0.1 ms per allocation the `Hello` counted (and the slack).
#[test]
fn a_dripping_listing_ends_at_its_deadline() {
    let Some(mut s) = copy_first("hostile-drip-list", "drip:700") else {
        return;
    };
    let w = dump_watched(&s, &[("GPUSNAP_AGENT_TIMEOUT_MS", "1000")]);
    assert_refused_and_job_runs_on(&mut s, &w.run, &["its listing did not end within"]);
    // The split path's Hellos and listings (two of each, at PAUSE and at the copy), each
    // listing cut at 1.1 s; the rest of the dump does not talk to the agent.
    assert!(
        w.took < Duration::from_secs(20),
        "the dump took {:?}\n{}",
        w.took,
        s.describe(&w.run)
    );
}

/// Item 6, the data: 1 MiB slots (16 chunks of 16 MiB), each reply 0.3 s late, within the 2 s
/// agent timeout. The copy used to go on for as long as replies kept coming; it now ends at
/// its deadline, 2 s + 16 MiB at 16 MiB/s + 1 ms a chunk, about 3 s after the ring was taken,
/// where the job would have taken 5 s.
#[test]
fn a_dripping_copy_ends_at_its_deadline() {
    let Some(mut s) = copy_first("hostile-drip-data", "drip:300") else {
        return;
    };
    let w = dump_watched(
        &s,
        &[
            ("GPUSNAP_AGENT_TIMEOUT_MS", "2000"),
            ("GPUSNAP_STAGING_SLOT_MIB", "1"),
        ],
    );
    assert_refused_and_job_runs_on(&mut s, &w.run, &["did not finish moving", "within 3.016"]);
    assert!(
        w.max_data <= LISTED + (1 << 20),
        "{} bytes of data files\n{}",
        w.max_data,
        s.describe(&w.run)
    );
}
