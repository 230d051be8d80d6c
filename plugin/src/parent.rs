//! The parent image an incremental dump compares against: found through the image directory's
//! `parent` link, read back and checked whole before anything of it is referenced.

use std::os::fd::BorrowedFd;
use std::time::Instant;

use gpusnap_image::AllocationRecord;

/// For an incremental dump: the parent image's chunks this process may reference, if the image
/// directory has a usable `parent` link and `incremental` is on. The parent is read and checked
/// first, every chunk of it (`verify_parent`): a damaged parent makes this a full dump, so an
/// image never references bytes that do not read back. Anything else is a full dump too, with
/// the reason in the log. (On the hand-over route this runs in the drain, beside CRIU's dump;
/// on the copy-first route, on the job's pause.)
pub fn parent_index(
    dir: BorrowedFd<'_>,
    pid: i32,
    nspid: u32,
    allocations: &[AllocationRecord],
    incremental: bool,
    threads: usize,
) -> Option<gpusnap_image::DedupIndex> {
    use gpusnap_image::ParentImage;
    let found = gpusnap_image::parent_for_dedup(dir, nspid, allocations);
    let index = match found {
        ParentImage::None => return None,
        _ if !incremental => {
            log::info!(
                "pid {pid}: the image directory has a parent link, but incremental = false: full dump"
            );
            return None;
        }
        ParentImage::Unusable(why) => {
            log::info!("pid {pid}: full dump, parent image not used: {why}");
            return None;
        }
        ParentImage::Usable(index) => index,
    };
    let t0 = Instant::now();
    match gpusnap_image::verify_parent(dir, nspid, threads) {
        Ok(Some(report)) => log::info!(
            "pid {pid}: parent image read back and checked: {:.2} GiB in {:.3} s",
            report.bytes as f64 / (1u64 << 30) as f64,
            t0.elapsed().as_secs_f64()
        ),
        Ok(None) => return None,
        Err(e) => {
            log::warn!(
                "pid {pid}: the parent image is damaged ({e}): a full dump instead, nothing of it referenced"
            );
            return None;
        }
    }
    log::info!(
        "pid {pid}: incremental dump against the parent image ({} chunks to compare{})",
        index.len(),
        if index.too_deep > 0 {
            format!(
                ", {} already {} links deep are stored again",
                index.too_deep,
                gpusnap_image::MAX_CHAIN_DEPTH
            )
        } else {
            String::new()
        }
    );
    Some(index)
}
