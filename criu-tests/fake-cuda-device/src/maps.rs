//! `/proc/self/maps`, read to check what lies at an address before the VMM calls act on it:
//! `mmap(MAP_FIXED)` replaces whatever is there, so mapping at a wrong address would silently
//! corrupt the process instead of failing as the real driver does.

use std::io;

/// One mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    /// `rwxp` / `rw-s` / `---p` ...
    pub perms: String,
    pub inode: u64,
    pub path: String,
}

/// Parses one line of `/proc/<pid>/maps`.
pub fn parse_line(line: &str) -> Option<Vma> {
    let mut f = line.split_ascii_whitespace();
    let (start, end) = f.next()?.split_once('-')?;
    let perms = f.next()?.to_owned();
    let _offset = f.next()?;
    let _dev = f.next()?;
    let inode = f.next()?.parse().ok()?;
    let path = f.collect::<Vec<_>>().join(" ");
    Some(Vma {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        perms,
        inode,
        path,
    })
}

/// The calling process's mappings, in address order.
pub fn read() -> io::Result<Vec<Vma>> {
    let text = std::fs::read_to_string("/proc/self/maps")?;
    Ok(text.lines().filter_map(parse_line).collect())
}

/// Whether `[start, end)` is covered without a gap by mappings that all satisfy `ok`.
pub fn covered(vmas: &[Vma], start: u64, end: u64, ok: impl Fn(&Vma) -> bool) -> bool {
    let mut at = start;
    for v in vmas.iter().filter(|v| v.end > start && v.start < end) {
        if v.start > at || !ok(v) {
            return false;
        }
        at = v.end;
    }
    at >= end
}

/// What `covered` reports for messages: the mappings overlapping the range.
pub fn describe(vmas: &[Vma], start: u64, end: u64) -> String {
    let parts: Vec<String> = vmas
        .iter()
        .filter(|v| v.end > start && v.start < end)
        .map(|v| format!("{:#x}-{:#x} {} {}", v.start, v.end, v.perms, v.path))
        .collect();
    if parts.is_empty() {
        "nothing mapped".into()
    } else {
        parts.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_checks_coverage() {
        let a = parse_line("7f0000000000-7f0000200000 ---p 00000000 00:00 0 ").unwrap();
        assert_eq!(
            (a.start, a.end, a.perms.as_str(), a.inode),
            (0x7f00_0000_0000, 0x7f00_0020_0000, "---p", 0)
        );
        let b = parse_line(
            "7f0000200000-7f0000400000 rw-s 00000000 00:01 77 /memfd:fakecuda-dev (deleted)",
        )
        .unwrap();
        assert_eq!(b.path, "/memfd:fakecuda-dev (deleted)");
        let v = vec![a, b];
        assert!(covered(&v, 0x7f00_0000_0000, 0x7f00_0020_0000, |v| v.perms
            == "---p"));
        assert!(!covered(&v, 0x7f00_0000_0000, 0x7f00_0040_0000, |v| v
            .perms
            == "---p"));
        assert!(covered(&v, 0x7f00_0000_0000, 0x7f00_0040_0000, |_| true));
        assert!(!covered(&v, 0x7f00_0040_0000, 0x7f00_0050_0000, |_| true));
        assert!(describe(&v, 0x7f00_0000_1000, 0x7f00_0000_2000).contains("---p"));
    }

    #[test]
    fn reads_own_maps() {
        let v = read().unwrap();
        assert!(v.iter().any(|m| m.path == "[stack]"));
    }
}
