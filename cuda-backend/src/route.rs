//! The route of each allocation of a split dump, decided at PAUSE from the agent's listing and
//! logged with its reason: lent to the keeper across the driver checkpoint (the hand-over), copied
//! out first (on the job's pause, before the driver checkpoint), or left to the driver's
//! checkpoint. A process may have allocations on both data routes: what it cannot lend is copied
//! out first, the rest is lent (`docs/design-notes.md`, "Hand-over").

use gpusnap_image::AllocationRecord;
use gpusnap_proto::AllocKind;

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

    /// Ids of the allocations to lend.
    pub fn lend_ids(&self) -> std::collections::BTreeSet<u64> {
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
        let mut by: std::collections::BTreeMap<AllocRoute, Vec<&AllocationRecord>> =
            Default::default();
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
}
