//! The route of each allocation of a split dump, decided at PAUSE from the agent's listing and
//! logged with its reason: lent to the keeper across the driver checkpoint (the hand-over), copied
//! out first (on the job's pause, before the driver checkpoint), or left to the driver's
//! checkpoint. A process may have allocations on both data routes: what it cannot lend is copied
//! out first, the rest is lent (`docs/design-notes.md`, "Hand-over"). With an asynchronous `-R`,
//! each lent allocation then goes into the keeper's snapshot or is drained on the pause
//! ([`SnapshotPlan`]).

use gpusnap_image::AllocationRecord;
use gpusnap_proto::AllocKind;
use std::collections::{BTreeMap, BTreeSet};

/// Where one allocation's data goes at a dump, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AllocRoute {
    /// Exported and lent to the keeper: its memory changes hands across the driver checkpoint
    /// and is drained beside CRIU's dump. Only memory the agent created exportable.
    Lend,
    /// Copied out through the ring before the driver checkpoint, on the job's pause.
    CopyFirst(CopyFirst),
    /// Not the agent's to move: the driver's checkpoint takes it with the control state.
    Driver(LeftToDriver),
}

/// Why an allocation is copied out first rather than lent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CopyFirst {
    /// The agent's conversion, created without a POSIX-fd handle type (the device has none).
    NotExportable,
    /// The mapping of one of the application's own `cuMemCreate` handles whose properties a
    /// keeper cannot make again at a restore (compression or usage flags, other handle types,
    /// another location): lent, it would come back as other memory.
    ApplicationProperties,
    /// The mapping of one of the application's own handles whose memory a hand-over mapped back
    /// from a descriptor: the driver will not export an imported handle again.
    ImportedHandle,
    /// `handover = false`.
    HandoverOff,
    /// No keeper could be started at PAUSE.
    NoKeeper,
    /// The job's driver library is not the host's (or the host's is not root's alone): a
    /// keeper, which runs as root, loads no library the job chose.
    DriverLibrary,
    /// The hand-over failed before any memory was released; everything is copied first.
    HandOverFailed,
}

/// Why an allocation the agent lists is not moved by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LeftToDriver {
    /// The application's own mapping, mapped twice or in part (never movable). Allocations under
    /// the agent's conversion threshold and `cudaMallocAsync` pools are not listed at all: the
    /// driver's checkpoint takes them too, unseen by the plugin.
    ApplicationMapping,
}

impl AllocRoute {
    /// The route by how the agent holds the allocation, with the hand-over available or not
    /// (`unavailable`: why every moved allocation is copied first).
    pub fn of(kind: AllocKind, unavailable: Option<CopyFirst>) -> AllocRoute {
        match (kind, unavailable) {
            (AllocKind::AppVmm, _) => AllocRoute::Driver(LeftToDriver::ApplicationMapping),
            (_, Some(why)) => AllocRoute::CopyFirst(why),
            (AllocKind::Converted | AllocKind::AppHandleLendable, None) => AllocRoute::Lend,
            (AllocKind::ConvertedNoExport, None) => AllocRoute::CopyFirst(CopyFirst::NotExportable),
            (AllocKind::AppHandleMapping, None) => {
                AllocRoute::CopyFirst(CopyFirst::ApplicationProperties)
            }
            (AllocKind::AppHandleImported, None) => {
                AllocRoute::CopyFirst(CopyFirst::ImportedHandle)
            }
        }
    }

    /// Words for the log.
    pub fn describe(self) -> &'static str {
        match self {
            AllocRoute::Lend => "lend (created exportable)",
            AllocRoute::CopyFirst(CopyFirst::NotExportable) => {
                "copy first (not exportable: the device has no POSIX-fd handles)"
            }
            AllocRoute::CopyFirst(CopyFirst::ApplicationProperties) => {
                "copy first (the application's own cuMemCreate handle, with properties a keeper cannot make again)"
            }
            AllocRoute::CopyFirst(CopyFirst::ImportedHandle) => {
                "copy first (the application's own cuMemCreate handle, imported at a hand-over: the driver will not export it again)"
            }
            AllocRoute::CopyFirst(CopyFirst::HandoverOff) => "copy first (handover = false)",
            AllocRoute::CopyFirst(CopyFirst::NoKeeper) => "copy first (no keeper)",
            AllocRoute::CopyFirst(CopyFirst::DriverLibrary) => {
                "copy first (the job's driver library is not the host's)"
            }
            AllocRoute::CopyFirst(CopyFirst::HandOverFailed) => {
                "copy first (the hand-over failed before any release)"
            }
            AllocRoute::Driver(LeftToDriver::ApplicationMapping) => {
                "left to the driver checkpoint (the application's own mapping, not movable)"
            }
        }
    }
}

/// The route of every allocation the agent listed, in its order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routes(pub Vec<(AllocationRecord, AllocRoute)>);

/// How many allocations the log names per reason.
const NAMED_PER_REASON: usize = 3;

impl Routes {
    pub fn decide(
        listed: &[(AllocationRecord, AllocKind)],
        unavailable: Option<CopyFirst>,
    ) -> Self {
        Routes(
            listed
                .iter()
                .map(|(a, k)| (a.clone(), AllocRoute::of(*k, unavailable)))
                .collect(),
        )
    }

    /// Every moved allocation copied first, for `why`.
    pub fn all_copy_first(&self, why: CopyFirst) -> Self {
        Routes(
            self.0
                .iter()
                .map(|(a, r)| match r {
                    AllocRoute::Driver(_) => (a.clone(), *r),
                    _ => (a.clone(), AllocRoute::CopyFirst(why)),
                })
                .collect(),
        )
    }

    fn count(&self, f: impl Fn(&AllocRoute) -> bool) -> usize {
        self.0.iter().filter(|(_, r)| f(r)).count()
    }

    pub fn lent(&self) -> usize {
        self.count(|r| *r == AllocRoute::Lend)
    }

    pub fn copied_first(&self) -> usize {
        self.count(|r| matches!(r, AllocRoute::CopyFirst(_)))
    }

    /// Bytes of the moved allocations that are lent (`lend`) or copied out first (`!lend`).
    pub fn moved_bytes(&self, lend: bool) -> u64 {
        self.0
            .iter()
            .filter(|(a, r)| a.moved && (*r == AllocRoute::Lend) == lend)
            .map(|(a, _)| a.size)
            .sum()
    }

    /// Ids of the allocations to lend.
    pub fn lend_ids(&self) -> BTreeSet<u64> {
        self.0
            .iter()
            .filter(|(_, r)| *r == AllocRoute::Lend)
            .map(|(a, _)| a.id)
            .collect()
    }

    /// Whether the same allocations take the same routes (the listing at the checkpoint
    /// against the one at PAUSE).
    pub fn same_as(&self, other: &Routes) -> bool {
        let key = |r: &Routes| {
            let mut v: Vec<(u64, u64, u64, AllocRoute)> =
                r.0.iter()
                    .map(|(a, r)| (a.id, a.addr, a.size, *r))
                    .collect();
            v.sort();
            v
        };
        key(self) == key(other)
    }

    /// The allocations for the image: each moved one marked `lent` where it is lent.
    pub fn records(&self) -> Vec<AllocationRecord> {
        self.0
            .iter()
            .map(|(a, r)| AllocationRecord {
                lent: a.moved && *r == AllocRoute::Lend,
                ..a.clone()
            })
            .collect()
    }

    /// The manifest's allocations for the copy-first part alone: what a reload needs once the
    /// lent ones are mapped back (they are left out: their data is not in these files).
    pub fn copy_first_records(&self) -> Vec<AllocationRecord> {
        self.0
            .iter()
            .filter(|(_, r)| *r != AllocRoute::Lend)
            .map(|(a, _)| AllocationRecord {
                lent: false,
                ..a.clone()
            })
            .collect()
    }

    /// One compact line: counts per route and reason, and the first few allocations of each.
    pub fn summary(&self) -> String {
        let mut by: BTreeMap<AllocRoute, Vec<&AllocationRecord>> = Default::default();
        for (a, r) in &self.0 {
            by.entry(*r).or_default().push(a);
        }
        let parts: Vec<String> = by
            .iter()
            .map(|(r, allocs)| {
                let named: Vec<String> = allocs
                    .iter()
                    .take(NAMED_PER_REASON)
                    .map(|a| format!("#{} at {:#x} ({} bytes)", a.id, a.addr, a.size))
                    .collect();
                let more = allocs.len().saturating_sub(NAMED_PER_REASON);
                format!(
                    "{} {}: {}{}",
                    allocs.len(),
                    r.describe(),
                    named.join(", "),
                    if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    }
                )
            })
            .collect();
        let rdma = self
            .0
            .iter()
            .filter(|(a, r)| a.rdma_capable && *r == AllocRoute::Lend)
            .count();
        format!(
            "routes: {} lent, {} copied first, {} left to the driver; {}{}",
            self.lent(),
            self.copied_first(),
            self.count(|r| matches!(r, AllocRoute::Driver(_))),
            if parts.is_empty() {
                "no allocation listed".to_owned()
            } else {
                parts.join("; ")
            },
            if rdma > 0 {
                format!("; {rdma} of the lent are RDMA-capable (made so again at a restore)")
            } else {
                String::new()
            }
        )
    }
}

/// What a GPU allows an asynchronous `-R`'s snapshot to take, as the keeper measured it, and
/// what the snapshot's plan took of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotBudget {
    /// The GPU's free memory, bytes.
    pub free: u64,
    /// What `async_snapshot_share` allows of it.
    pub allowed: u64,
    /// What the plan's snapshot takes there.
    pub taken: u64,
}

/// An asynchronous `-R`'s choice, per lent allocation: into the keeper's snapshot (drained
/// after CRIU returns) or drained on the pause, as without the route. Largest first: each lent
/// allocation, the largest first (equal sizes in address order), goes into the snapshot where
/// it fits what is left of its GPU's budget (`async_snapshot_share` percent of that GPU's free
/// memory), else it is drained on the pause. So the snapshot never takes more than the share,
/// and what the pause drains is as little as the budget allows, one allocation after the
/// other.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotPlan {
    /// The allocations the snapshot takes, by id.
    pub snapshot: BTreeSet<u64>,
    /// Every lent allocation in the listing's order, and whether the snapshot takes it.
    lent: Vec<(AllocationRecord, bool)>,
    /// Each GPU with lent memory.
    pub gpus: BTreeMap<u32, SnapshotBudget>,
}

impl SnapshotPlan {
    /// The GPUs the lent allocations of `routes` are on (whose room the keeper is asked).
    pub fn devices(routes: &Routes) -> BTreeSet<u32> {
        lent_of(routes).map(|a| a.device).collect()
    }

    /// The plan for the lent allocations of `routes` with `room`, per GPU `(free, allowed)`;
    /// a GPU `room` does not name allows nothing.
    pub fn choose(routes: &Routes, room: &BTreeMap<u32, (u64, u64)>) -> SnapshotPlan {
        let mut gpus: BTreeMap<u32, SnapshotBudget> = Self::devices(routes)
            .into_iter()
            .map(|d| {
                let (free, allowed) = room.get(&d).copied().unwrap_or_default();
                (
                    d,
                    SnapshotBudget {
                        free,
                        allowed,
                        taken: 0,
                    },
                )
            })
            .collect();
        let mut order: Vec<&AllocationRecord> = lent_of(routes).collect();
        order.sort_by_key(|a| (std::cmp::Reverse(a.size), a.addr, a.id));
        let mut snapshot = BTreeSet::new();
        for a in order {
            let Some(b) = gpus.get_mut(&a.device) else {
                continue;
            };
            if b.taken.saturating_add(a.size) <= b.allowed {
                b.taken += a.size;
                snapshot.insert(a.id);
            }
        }
        let lent = lent_of(routes)
            .map(|a| (a.clone(), snapshot.contains(&a.id)))
            .collect();
        SnapshotPlan {
            snapshot,
            lent,
            gpus,
        }
    }

    /// Whether the snapshot takes every lent allocation (nothing is drained on the pause).
    pub fn whole(&self) -> bool {
        self.lent.iter().all(|(_, s)| *s)
    }

    /// How many lent allocations, and their bytes, the snapshot takes (`true`) or the pause
    /// drains (`false`).
    pub fn part(&self, snapshot: bool) -> (usize, u64) {
        self.lent
            .iter()
            .filter(|(_, s)| *s == snapshot)
            .fold((0, 0), |(n, b), (a, _)| (n + 1, b + a.size))
    }

    /// One line for the log: how many allocations and bytes go each way, the first few of
    /// each named, and why (each GPU's free memory, what the share allows, what is taken).
    pub fn summary(&self, share_percent: u32) -> String {
        let named = |snapshot: bool| {
            let all: Vec<&AllocationRecord> = self
                .lent
                .iter()
                .filter(|(_, s)| *s == snapshot)
                .map(|(a, _)| a)
                .collect();
            let mut v: Vec<String> = all
                .iter()
                .take(NAMED_PER_REASON)
                .map(|a| format!("#{} at {:#x} ({} bytes)", a.id, a.addr, a.size))
                .collect();
            if all.len() > NAMED_PER_REASON {
                v.push(format!("and {} more", all.len() - NAMED_PER_REASON));
            }
            if v.is_empty() {
                "none".to_owned()
            } else {
                v.join(", ")
            }
        };
        let ((sn, sb), (pn, pb)) = (self.part(true), self.part(false));
        let gpus: Vec<String> = self
            .gpus
            .iter()
            .map(|(d, b)| {
                format!(
                    "GPU {d}: {} free, {} allowed, {} taken",
                    size_words(b.free),
                    size_words(b.allowed),
                    size_words(b.taken)
                )
            })
            .collect();
        format!(
            "asynchronous -R per allocation (largest first, each where it fits what is left of async_snapshot_share = {share_percent}% of its GPU's free memory): {sn} into the keeper's snapshot ({}), drained after CRIU returns: {}; {pn} drained on the pause ({}), not fitting: {}; {}",
            size_words(sb),
            named(true),
            size_words(pb),
            named(false),
            gpus.join("; ")
        )
    }
}

/// The lent allocations of `routes`.
fn lent_of(routes: &Routes) -> impl Iterator<Item = &AllocationRecord> {
    routes
        .0
        .iter()
        .filter(|(a, r)| a.moved && *r == AllocRoute::Lend)
        .map(|(a, _)| a)
}

/// Bytes in words for the log: MiB below a GiB, else GiB.
pub fn size_words(bytes: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes < 1 << 30 {
        format!("{:.2} MiB", bytes as f64 / MIB)
    } else {
        format!("{:.2} GiB", bytes as f64 / (MIB * 1024.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: u64, moved: bool) -> AllocationRecord {
        AllocationRecord {
            id,
            device: 0,
            addr: 0x1000 * id,
            size: 0x1000,
            moved,
            lent: false,
            rdma_capable: false,
        }
    }

    fn listed() -> Vec<(AllocationRecord, AllocKind)> {
        vec![
            (rec(1, true), AllocKind::Converted),
            (rec(2, true), AllocKind::Converted),
            (rec(3, true), AllocKind::AppHandleMapping),
            (rec(4, false), AllocKind::AppVmm),
            (rec(5, true), AllocKind::ConvertedNoExport),
            (rec(6, true), AllocKind::Converted),
            (rec(7, true), AllocKind::Converted),
            (rec(8, true), AllocKind::Converted),
        ]
    }

    #[test]
    fn each_allocation_takes_its_own_route() {
        let r = Routes::decide(&listed(), None);
        assert_eq!((r.lent(), r.copied_first()), (5, 2));
        assert_eq!(
            r.lend_ids().into_iter().collect::<Vec<_>>(),
            [1, 2, 6, 7, 8]
        );
        assert_eq!(
            r.0[2].1,
            AllocRoute::CopyFirst(CopyFirst::ApplicationProperties)
        );
        assert_eq!(
            r.0[3].1,
            AllocRoute::Driver(LeftToDriver::ApplicationMapping)
        );
        assert_eq!(r.0[4].1, AllocRoute::CopyFirst(CopyFirst::NotExportable));
        let recs = r.records();
        assert!(recs[0].lent && !recs[2].lent && !recs[3].lent && !recs[4].lent);
        // The copy-first part leaves the lent ones out, keeps the driver's.
        let part: Vec<u64> = r.copy_first_records().iter().map(|a| a.id).collect();
        assert_eq!(part, [3, 4, 5]);
    }

    #[test]
    fn without_a_hand_over_every_moved_allocation_is_copied_first() {
        let r = Routes::decide(&listed(), Some(CopyFirst::HandoverOff));
        assert_eq!((r.lent(), r.copied_first()), (0, 7));
        assert_eq!(
            r.0[3].1,
            AllocRoute::Driver(LeftToDriver::ApplicationMapping)
        );
        let failed = Routes::decide(&listed(), None).all_copy_first(CopyFirst::HandOverFailed);
        assert_eq!((failed.lent(), failed.copied_first()), (0, 7));
        assert!(!failed.same_as(&Routes::decide(&listed(), None)));
        assert!(Routes::decide(&listed(), None).same_as(&Routes::decide(&listed(), None)));
    }

    #[test]
    fn the_summary_counts_per_reason_and_names_the_first_few() {
        let s = Routes::decide(&listed(), None).summary();
        assert!(
            s.starts_with("routes: 5 lent, 2 copied first, 1 left to the driver; "),
            "{s}"
        );
        assert!(
            s.contains("5 lend (created exportable): #1 at 0x1000 (4096 bytes), #2 at 0x2000 (4096 bytes), #6 at 0x6000 (4096 bytes) and 2 more"),
            "{s}"
        );
        assert!(
            s.contains("1 copy first (the application's own cuMemCreate handle"),
            "{s}"
        );
        assert!(!s.contains("#7"), "only the first few are named: {s}");
    }

    #[test]
    fn application_handles_route_by_what_a_keeper_can_make() {
        let rdma = AllocationRecord {
            rdma_capable: true,
            ..rec(1, true)
        };
        let listed = vec![
            (rdma, AllocKind::AppHandleLendable),
            (rec(2, true), AllocKind::AppHandleMapping),
            (rec(3, true), AllocKind::AppHandleImported),
        ];
        let r = Routes::decide(&listed, None);
        assert_eq!(r.0[0].1, AllocRoute::Lend);
        assert_eq!(
            r.0[1].1,
            AllocRoute::CopyFirst(CopyFirst::ApplicationProperties)
        );
        assert_eq!(r.0[2].1, AllocRoute::CopyFirst(CopyFirst::ImportedHandle));
        // The image keeps what the keeper must make.
        let recs = r.records();
        assert!(recs[0].lent && recs[0].rdma_capable);
        assert!(!recs[1].lent && !recs[1].rdma_capable);
        let s = r.summary();
        assert!(
            s.starts_with("routes: 1 lent, 2 copied first, 0 left"),
            "{s}"
        );
        assert!(
            s.contains("with properties a keeper cannot make again"),
            "{s}"
        );
        assert!(s.contains("imported at a hand-over"), "{s}");
        assert!(
            s.ends_with("; 1 of the lent are RDMA-capable (made so again at a restore)"),
            "{s}"
        );
    }

    fn lent(id: u64, device: u32, addr: u64, size: u64) -> (AllocationRecord, AllocRoute) {
        (
            AllocationRecord {
                id,
                device,
                addr,
                size,
                moved: true,
                lent: false,
                rdma_capable: false,
            },
            AllocRoute::Lend,
        )
    }

    const MIB: u64 = 1 << 20;

    /// A job of 3 allocations of 4, 6 and 4 MiB and a counter of 1 MiB on GPU 0, 2 of 8 MiB on
    /// GPU 1, and one copied first (never in a snapshot).
    fn job() -> Routes {
        let mut r = Routes(vec![
            lent(1, 0, 0x100_0000, 4 * MIB),
            lent(2, 0, 0x200_0000, 6 * MIB),
            lent(3, 0, 0x300_0000, 4 * MIB),
            lent(4, 0, 0x400_0000, MIB),
            lent(5, 1, 0x500_0000, 8 * MIB),
            lent(6, 1, 0x600_0000, 8 * MIB),
        ]);
        r.0.push((
            rec(7, true),
            AllocRoute::CopyFirst(CopyFirst::NotExportable),
        ));
        r
    }

    fn room(of: &[(u32, u64)]) -> BTreeMap<u32, (u64, u64)> {
        of.iter().map(|&(d, a)| (d, (2 * a, a))).collect()
    }

    #[test]
    fn the_snapshot_takes_the_largest_first_within_each_gpu_s_budget() {
        let r = job();
        assert_eq!(
            SnapshotPlan::devices(&r).into_iter().collect::<Vec<_>>(),
            [0, 1]
        );
        // GPU 0 allows 9 MiB: 6 MiB fits, neither 4 MiB one then (10 > 9), the counter does
        // (7); GPU 1 allows 8 MiB: one of its two.
        let p = SnapshotPlan::choose(&r, &room(&[(0, 9 * MIB), (1, 8 * MIB)]));
        assert_eq!(p.snapshot.iter().copied().collect::<Vec<_>>(), [2, 4, 5]);
        assert_eq!(p.part(true), (3, 15 * MIB));
        assert_eq!(p.part(false), (3, 16 * MIB));
        assert!(!p.whole());
        assert_eq!(p.gpus[&0].taken, 7 * MIB);
        assert_eq!(p.gpus[&1].taken, 8 * MIB);
        // Equal sizes go in address order: 10 MiB on GPU 0 takes 6 + the first 4.
        let p = SnapshotPlan::choose(&r, &room(&[(0, 10 * MIB)]));
        assert_eq!(p.snapshot.iter().copied().collect::<Vec<_>>(), [1, 2]);
        // A GPU the keeper gave no room for allows nothing.
        assert_eq!(p.gpus[&1], SnapshotBudget::default());
        // Everything fits: the whole snapshot, as before the per-allocation route.
        let p = SnapshotPlan::choose(&r, &room(&[(0, 15 * MIB), (1, 16 * MIB)]));
        assert!(p.whole());
        assert_eq!(p.part(false), (0, 0));
        // Nothing fits.
        let p = SnapshotPlan::choose(&r, &room(&[(0, MIB - 1), (1, MIB)]));
        assert!(p.snapshot.is_empty() && !p.whole());
    }

    #[test]
    fn the_snapshot_summary_names_both_parts_and_why() {
        let p = SnapshotPlan::choose(&job(), &room(&[(0, 9 * MIB), (1, 8 * MIB)]));
        let s = p.summary(50);
        assert!(
            s.starts_with("asynchronous -R per allocation (largest first, each where it fits what is left of async_snapshot_share = 50% of its GPU's free memory): 3 into the keeper's snapshot (15.00 MiB), drained after CRIU returns: #2 at 0x2000000"),
            "{s}"
        );
        assert!(
            s.contains("3 drained on the pause (16.00 MiB), not fitting: #1 at 0x1000000 (4194304 bytes), #3"),
            "{s}"
        );
        assert!(
            s.ends_with("GPU 0: 18.00 MiB free, 9.00 MiB allowed, 7.00 MiB taken; GPU 1: 16.00 MiB free, 8.00 MiB allowed, 8.00 MiB taken"),
            "{s}"
        );
        assert_eq!(size_words(3 << 30), "3.00 GiB");
    }
}
