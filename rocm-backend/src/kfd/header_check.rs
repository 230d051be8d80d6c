//! Checks the handwritten definitions of [`super::sys`] against the text of the Linux uapi header
//! `linux/kfd_ioctl.h`, where it is installed (Debian: linux-libc-dev). The header cannot simply
//! be compiled: it includes `drm/drm.h`, which lives in another package. So this parses the few
//! definitions used, computes their C layout (all fields are `__u32`/`__u64`), and compares.

use super::sys::*;
use std::mem::{offset_of, size_of};

const HEADER: &str = "/usr/include/linux/kfd_ioctl.h";

/// The header's text, or `None` (the calling test is skipped, and says so: on the real stderr,
/// as `eprintln!` is captured for a passing test, in the form scripts/test.sh lists).
fn header(test: &str) -> Option<String> {
    match std::fs::read_to_string(HEADER) {
        Ok(text) => Some(text),
        Err(e) => {
            use std::io::Write;
            let line = format!(
                "gpusnap-rocm: SKIPPED {test}: cannot read {HEADER} ({e}; Debian: linux-libc-dev)\n"
            );
            let _ = std::io::stderr().write_all(line.as_bytes());
            None
        }
    }
}

/// The text with `/* */` and `//` comments removed.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                let end = rest[b..].find("*/").expect("unterminated comment") + b + 2;
                rest = &rest[end..];
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |e| &rest[l + e..]);
            }
            (None, None) => {
                out.push_str(rest);
                return out;
            }
            (Some(_), None) => unreachable!(),
        }
    }
}

/// The C layout of `struct name`: (size, [(field, offset)]).
fn c_layout(text: &str, name: &str) -> (usize, Vec<(String, usize)>) {
    let open = format!("struct {name} {{");
    let start = text.find(&open).unwrap_or_else(|| panic!("no {open}")) + open.len();
    let body = &text[start..start + text[start..].find("};").expect("unterminated struct")];
    let mut offset: usize = 0;
    let mut max_align = 1;
    let mut fields = Vec::new();
    for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        let mut words = decl.split_whitespace();
        let (ty, field) = (words.next().unwrap(), words.next().unwrap());
        assert!(words.next().is_none(), "unexpected declaration {decl:?}");
        let size = match ty {
            "__u32" => 4,
            "__u64" => 8,
            _ => panic!("type {ty} in struct {name} is not handled"),
        };
        offset = offset.next_multiple_of(size);
        max_align = max_align.max(size);
        fields.push((field.to_owned(), offset));
        offset += size;
    }
    (offset.next_multiple_of(max_align), fields)
}

/// The enumerators of `enum name`, with their values.
fn c_enum(text: &str, name: &str) -> Vec<(String, u32)> {
    let open = format!("enum {name} {{");
    let start = text.find(&open).unwrap_or_else(|| panic!("no {open}")) + open.len();
    let body = &text[start..start + text[start..].find("};").unwrap()];
    let mut next = 0;
    let mut out = Vec::new();
    for item in body.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (ident, value) = match item.split_once('=') {
            Some((i, v)) => (i.trim(), v.trim().parse().unwrap()),
            None => (item, next),
        };
        out.push((ident.to_owned(), value));
        next = value + 1;
    }
    out
}

/// The replacement text of `#define name`, with line continuations joined.
fn c_define(text: &str, name: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|l| {
            let mut w = l.split_whitespace();
            w.next() == Some("#define") && w.next() == Some(name)
        })
        .unwrap_or_else(|| panic!("no #define {name}"));
    let mut value = lines[at].trim_start()["#define".len()..].trim_start()[name.len()..].to_owned();
    let mut i = at;
    while value.trim_end().ends_with('\\') {
        value = value.trim_end().trim_end_matches('\\').to_owned();
        i += 1;
        value.push(' ');
        value.push_str(lines[i]);
    }
    value.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The ioctl number of `#define name AMDKFD_IO{R,WR}(nr, struct s)`, computed from the C layout.
fn c_ioctl(text: &str, name: &str) -> u32 {
    let def = c_define(text, name);
    let (mac, args) = def.split_once('(').unwrap();
    let args = args.trim_end_matches(')');
    let (nr, ty) = args.split_once(',').unwrap();
    let nr = u8::from_str_radix(nr.trim().trim_start_matches("0x"), 16).unwrap();
    let strukt = ty.trim().strip_prefix("struct ").unwrap();
    let (size, _) = c_layout(text, strukt);
    match mac.trim() {
        "AMDKFD_IOR" => ior(AMDKFD_IOCTL_BASE, nr, size),
        "AMDKFD_IOWR" => iowr(AMDKFD_IOCTL_BASE, nr, size),
        other => panic!("{name} uses {other}, not handled"),
    }
}

fn assert_layout(text: &str, name: &str, rust_size: usize, rust_fields: &[(&str, usize)]) {
    let (size, fields) = c_layout(text, name);
    assert_eq!(size, rust_size, "size of struct {name}");
    let rust: Vec<(String, usize)> = rust_fields
        .iter()
        .map(|(f, o)| ((*f).to_owned(), *o))
        .collect();
    assert_eq!(fields, rust, "fields of struct {name}");
}

#[test]
fn structs_match_header() {
    let Some(text) = header("structs_match_header") else {
        return;
    };
    let text = strip_comments(&text);
    assert_layout(
        &text,
        "kfd_ioctl_get_version_args",
        size_of::<KfdIoctlGetVersionArgs>(),
        &[
            (
                "major_version",
                offset_of!(KfdIoctlGetVersionArgs, major_version),
            ),
            (
                "minor_version",
                offset_of!(KfdIoctlGetVersionArgs, minor_version),
            ),
        ],
    );
    assert_layout(
        &text,
        "kfd_ioctl_criu_args",
        size_of::<KfdIoctlCriuArgs>(),
        &[
            ("devices", offset_of!(KfdIoctlCriuArgs, devices)),
            ("bos", offset_of!(KfdIoctlCriuArgs, bos)),
            ("priv_data", offset_of!(KfdIoctlCriuArgs, priv_data)),
            (
                "priv_data_size",
                offset_of!(KfdIoctlCriuArgs, priv_data_size),
            ),
            ("num_devices", offset_of!(KfdIoctlCriuArgs, num_devices)),
            ("num_bos", offset_of!(KfdIoctlCriuArgs, num_bos)),
            ("num_objects", offset_of!(KfdIoctlCriuArgs, num_objects)),
            ("pid", offset_of!(KfdIoctlCriuArgs, pid)),
            ("op", offset_of!(KfdIoctlCriuArgs, op)),
        ],
    );
    assert_layout(
        &text,
        "kfd_criu_device_bucket",
        size_of::<KfdCriuDeviceBucket>(),
        &[
            ("user_gpu_id", offset_of!(KfdCriuDeviceBucket, user_gpu_id)),
            (
                "actual_gpu_id",
                offset_of!(KfdCriuDeviceBucket, actual_gpu_id),
            ),
            ("drm_fd", offset_of!(KfdCriuDeviceBucket, drm_fd)),
            ("pad", offset_of!(KfdCriuDeviceBucket, pad)),
        ],
    );
    assert_layout(
        &text,
        "kfd_criu_bo_bucket",
        size_of::<KfdCriuBoBucket>(),
        &[
            ("addr", offset_of!(KfdCriuBoBucket, addr)),
            ("size", offset_of!(KfdCriuBoBucket, size)),
            ("offset", offset_of!(KfdCriuBoBucket, offset)),
            (
                "restored_offset",
                offset_of!(KfdCriuBoBucket, restored_offset),
            ),
            ("gpu_id", offset_of!(KfdCriuBoBucket, gpu_id)),
            ("alloc_flags", offset_of!(KfdCriuBoBucket, alloc_flags)),
            ("dmabuf_fd", offset_of!(KfdCriuBoBucket, dmabuf_fd)),
            ("pad", offset_of!(KfdCriuBoBucket, pad)),
        ],
    );
}

#[test]
fn ioctl_numbers_match_header() {
    let Some(text) = header("ioctl_numbers_match_header") else {
        return;
    };
    let text = strip_comments(&text);
    assert_eq!(c_define(&text, "AMDKFD_IOCTL_BASE"), "'K'");
    assert_eq!(c_ioctl(&text, "AMDKFD_IOC_CRIU_OP"), AMDKFD_IOC_CRIU_OP);
    assert_eq!(
        c_ioctl(&text, "AMDKFD_IOC_GET_VERSION"),
        AMDKFD_IOC_GET_VERSION
    );
}

#[test]
fn criu_ops_match_header() {
    let Some(text) = header("criu_ops_match_header") else {
        return;
    };
    let text = strip_comments(&text);
    let expected: Vec<(String, u32)> = [
        ("KFD_CRIU_OP_PROCESS_INFO", KfdCriuOp::ProcessInfo),
        ("KFD_CRIU_OP_CHECKPOINT", KfdCriuOp::Checkpoint),
        ("KFD_CRIU_OP_UNPAUSE", KfdCriuOp::Unpause),
        ("KFD_CRIU_OP_RESTORE", KfdCriuOp::Restore),
        ("KFD_CRIU_OP_RESUME", KfdCriuOp::Resume),
    ]
    .into_iter()
    .map(|(n, op)| (n.to_owned(), op as u32))
    .collect();
    assert_eq!(c_enum(&text, "kfd_criu_op"), expected);
}

#[test]
fn alloc_flags_match_header() {
    let Some(text) = header("alloc_flags_match_header") else {
        return;
    };
    let text = strip_comments(&text);
    for (name, value) in [
        ("KFD_IOC_ALLOC_MEM_FLAGS_VRAM", KFD_IOC_ALLOC_MEM_FLAGS_VRAM),
        ("KFD_IOC_ALLOC_MEM_FLAGS_GTT", KFD_IOC_ALLOC_MEM_FLAGS_GTT),
        (
            "KFD_IOC_ALLOC_MEM_FLAGS_USERPTR",
            KFD_IOC_ALLOC_MEM_FLAGS_USERPTR,
        ),
        (
            "KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL",
            KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL,
        ),
        (
            "KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP",
            KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP,
        ),
    ] {
        let def = c_define(&text, name);
        let shift: u32 = def
            .trim_matches(|c| c == '(' || c == ')')
            .strip_prefix("1 << ")
            .unwrap_or_else(|| panic!("{name} is {def}"))
            .parse()
            .unwrap();
        assert_eq!(1u32 << shift, value, "{name}");
    }
}

#[test]
fn invalid_fd_matches_header() {
    let Some(text) = header("invalid_fd_matches_header") else {
        return;
    };
    let text = strip_comments(&text);
    let v = c_define(&text, "KFD_INVALID_FD");
    let v = u32::from_str_radix(v.trim_start_matches("0x"), 16).unwrap();
    assert_eq!(v, KFD_INVALID_FD);
}

#[test]
fn header_supports_criu() {
    let Some(text) = header("header_supports_criu") else {
        return;
    };
    let major: u32 = c_define(&text, "KFD_IOCTL_MAJOR_VERSION").parse().unwrap();
    let minor: u32 = c_define(&text, "KFD_IOCTL_MINOR_VERSION").parse().unwrap();
    assert!((major, minor) >= KFD_CRIU_MIN_VERSION, "{major}.{minor}");
}

#[test]
fn comment_stripping() {
    assert_eq!(strip_comments("a /* b */ c // d\ne"), "a  c \ne");
    assert_eq!(strip_comments("x // y /* z */\nw"), "x \nw");
}
