//! Reading and editing CRIU's `inventory.img`: the list of plugins a dump needs.
//!
//! Layout (CRIU 4.1.1): a little-endian u32 magic [`INVENTORY_MAGIC`], then one protobuf message
//! `inventory_entry` preceded by its length as a little-endian u32.
//!
//! Since CRIU 4.0 the plugins that a restore needs are listed in field 12 of `inventory_entry`,
//! `optional plugins_entry plugins_entry = 12`, an embedded message whose field 12 is
//! `repeated string plugins`. Field numbers as compiled into `.criu-root/usr/sbin/criu` (read from
//! its protobuf-c descriptors `inventory_entry__descriptor` and `plugins_entry__descriptor`):
//!
//! ```text
//! inventory_entry: img_version 1, fdinfo_per_id 2, root_ids 3, ns_per_id 4, root_cg_set 5,
//!                  lsmtype 6, dump_uptime 8, pre_dump_mode 9, tcp_close 10,
//!                  network_lock_method 11, plugins_entry 12 (message), dump_criu_run_id 13
//! plugins_entry:   plugins 12 (repeated string)
//! ```
//!
//! CRIU 4.1.1 always writes `plugins_entry`, empty (`62 00`) when no plugin registered itself.
//! At restore, a plugin asks `check_and_remove_inventory_plugin(name)` whether it is listed.

use std::fs;
use std::path::Path;

/// First four bytes of `inventory.img` (`INVENTORY_MAGIC` in CRIU's `magic.h`), little-endian.
pub const INVENTORY_MAGIC: u32 = 0x5831_3116;
/// `inventory_entry.plugins_entry` (an embedded `plugins_entry` message).
pub const INVENTORY_PLUGINS_ENTRY_FIELD: u32 = 12;
/// `plugins_entry.plugins` (repeated string).
pub const PLUGINS_ENTRY_PLUGINS_FIELD: u32 = 12;

const WIRE_VARINT: u8 = 0;
const WIRE_I64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_I32: u8 = 5;

/// One top-level field of a protobuf message: its number, wire type and the bytes of its value
/// (for `LEN` fields, the payload without the length prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Field {
    number: u32,
    wire: u8,
    value: Vec<u8>,
}

fn read_varint(b: &[u8], pos: &mut usize) -> Result<u64, String> {
    let mut v: u64 = 0;
    for shift in (0..64).step_by(7) {
        let byte = *b
            .get(*pos)
            .ok_or_else(|| format!("truncated varint at byte {pos}"))?;
        *pos += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(format!("varint longer than 10 bytes before byte {pos}"))
}

fn write_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn take<'a>(b: &'a [u8], pos: &mut usize, n: u64) -> Result<&'a [u8], String> {
    let end = usize::try_from(n)
        .ok()
        .and_then(|n| pos.checked_add(n))
        .filter(|&e| e <= b.len())
        .ok_or_else(|| format!("field of {n} bytes at byte {pos} runs past the end"))?;
    let s = &b[*pos..end];
    *pos = end;
    Ok(s)
}

/// Splits a protobuf message into its top-level fields, in order.
fn parse_fields(b: &[u8]) -> Result<Vec<Field>, String> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < b.len() {
        let key = read_varint(b, &mut pos)?;
        let number = u32::try_from(key >> 3).map_err(|_| format!("field number {}", key >> 3))?;
        let wire = (key & 7) as u8;
        if number == 0 {
            return Err(format!("field number 0 before byte {pos}"));
        }
        let value = match wire {
            WIRE_VARINT => {
                let start = pos;
                read_varint(b, &mut pos)?;
                b[start..pos].to_vec()
            }
            WIRE_I64 => take(b, &mut pos, 8)?.to_vec(),
            WIRE_LEN => {
                let n = read_varint(b, &mut pos)?;
                take(b, &mut pos, n)?.to_vec()
            }
            WIRE_I32 => take(b, &mut pos, 4)?.to_vec(),
            w => return Err(format!("field {number}: unsupported wire type {w}")),
        };
        out.push(Field {
            number,
            wire,
            value,
        });
    }
    Ok(out)
}

fn encode_fields(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in fields {
        write_varint(&mut out, (u64::from(f.number) << 3) | u64::from(f.wire));
        if f.wire == WIRE_LEN {
            write_varint(&mut out, f.value.len() as u64);
        }
        out.extend_from_slice(&f.value);
    }
    out
}

/// Splits `inventory.img` bytes into the `inventory_entry` message.
fn entry_of(img: &[u8]) -> Result<&[u8], String> {
    if img.len() < 8 {
        return Err(format!("{} bytes: too short for an inventory", img.len()));
    }
    let magic = u32::from_le_bytes(img[0..4].try_into().expect("4 bytes"));
    if magic != INVENTORY_MAGIC {
        return Err(format!(
            "magic {magic:#010x}, expected {INVENTORY_MAGIC:#010x}"
        ));
    }
    let len = u32::from_le_bytes(img[4..8].try_into().expect("4 bytes")) as usize;
    if img.len() != 8 + len {
        return Err(format!(
            "entry length {len}, but the file has {} bytes after the header",
            img.len() - 8
        ));
    }
    Ok(&img[8..])
}

/// The plugin names listed in `inventory.img` bytes.
pub fn inventory_plugins(img: &[u8]) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    for f in parse_fields(entry_of(img)?)? {
        if f.number != INVENTORY_PLUGINS_ENTRY_FIELD {
            continue;
        }
        if f.wire != WIRE_LEN {
            return Err(format!("plugins_entry has wire type {}", f.wire));
        }
        for p in parse_fields(&f.value)? {
            if p.number == PLUGINS_ENTRY_PLUGINS_FIELD && p.wire == WIRE_LEN {
                names.push(String::from_utf8(p.value).map_err(|e| format!("plugin name: {e}"))?);
            }
        }
    }
    Ok(names)
}

/// `inventory.img` bytes with `name` added to the plugin list (appended to the existing
/// `plugins_entry`, or in a new one if there is none). Unchanged if `name` is listed already.
pub fn with_inventory_plugin(img: &[u8], name: &str) -> Result<Vec<u8>, String> {
    if inventory_plugins(img)?.iter().any(|n| n == name) {
        return Ok(img.to_vec());
    }
    let mut fields = parse_fields(entry_of(img)?)?;
    let plugin = Field {
        number: PLUGINS_ENTRY_PLUGINS_FIELD,
        wire: WIRE_LEN,
        value: name.as_bytes().to_vec(),
    };
    match fields
        .iter_mut()
        .find(|f| f.number == INVENTORY_PLUGINS_ENTRY_FIELD)
    {
        Some(entry) => entry.value.extend(encode_fields(&[plugin])),
        None => fields.push(Field {
            number: INVENTORY_PLUGINS_ENTRY_FIELD,
            wire: WIRE_LEN,
            value: encode_fields(&[plugin]),
        }),
    }
    let body = encode_fields(&fields);
    let len = u32::try_from(body.len()).map_err(|_| "inventory entry too large".to_string())?;
    let mut out = INVENTORY_MAGIC.to_le_bytes().to_vec();
    out.extend(len.to_le_bytes());
    out.extend(body);
    Ok(out)
}

/// Adds `name` to the plugin list of the `inventory.img` at `path`, in place (see
/// [`with_inventory_plugin`]). Afterwards a restore from that directory asks for the plugin.
pub fn add_inventory_plugin(path: &Path, name: &str) -> Result<(), String> {
    let err = |e: String| format!("{}: {e}", path.display());
    let img = fs::read(path).map_err(|e| err(e.to_string()))?;
    let new = with_inventory_plugin(&img, name).map_err(err)?;
    fs::write(path, new).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `inventory.img` of a CPU-only `criu dump` by CRIU 4.1.1: img_version 2, fdinfo_per_id,
    /// root_ids, ns_per_id, root_cg_set, lsmtype, network_lock_method, an empty plugins_entry
    /// (`62 00`) and dump_criu_run_id.
    const CRIU_411_INVENTORY: &[u8] = &[
        0x16, 0x31, 0x31, 0x58, 0x4e, 0x00, 0x00, 0x00, 0x08, 0x02, 0x10, 0x01, 0x1a, 0x18, 0x08,
        0x01, 0x10, 0x01, 0x18, 0x01, 0x20, 0x01, 0x28, 0x01, 0x30, 0x02, 0x38, 0x03, 0x40, 0x04,
        0x48, 0x06, 0x50, 0x07, 0x58, 0x08, 0x60, 0x05, 0x20, 0x01, 0x28, 0x01, 0x30, 0x00, 0x58,
        0x00, 0x62, 0x00, 0x6a, 0x24, b'7', b'd', b'1', b'7', b'3', b'f', b'5', b'a', b'-', b'8',
        b'd', b'b', b'b', b'-', b'4', b'1', b'8', b'e', b'-', b'8', b'b', b'4', b'0', b'-', b'e',
        b'0', b'f', b'0', b'1', b'2', b'7', b'6', b'1', b'3', b'3', b'7',
    ];

    #[test]
    fn real_inventory_parses_with_no_plugins() {
        let fields = parse_fields(entry_of(CRIU_411_INVENTORY).unwrap()).unwrap();
        let numbers: Vec<u32> = fields.iter().map(|f| f.number).collect();
        assert_eq!(numbers, [1, 2, 3, 4, 5, 6, 11, 12, 13]);
        assert_eq!(encode_fields(&fields), &CRIU_411_INVENTORY[8..]);
        assert!(inventory_plugins(CRIU_411_INVENTORY).unwrap().is_empty());
    }

    #[test]
    fn adds_plugin_to_existing_entry_and_fixes_length() {
        let new = with_inventory_plugin(CRIU_411_INVENTORY, "gpusnap").unwrap();
        assert_eq!(inventory_plugins(&new).unwrap(), ["gpusnap"]);
        // The empty `62 00` became `62 09 62 07 "gpusnap"`; nothing else changed.
        assert_eq!(new.len(), CRIU_411_INVENTORY.len() + 9);
        assert_eq!(u32::from_le_bytes(new[4..8].try_into().unwrap()), 0x4e + 9);
        let at = CRIU_411_INVENTORY
            .windows(2)
            .position(|w| w == [0x62, 0x00])
            .unwrap();
        assert_eq!(&new[..4], &CRIU_411_INVENTORY[..4]);
        assert_eq!(&new[8..at], &CRIU_411_INVENTORY[8..at]);
        assert_eq!(&new[at..at + 4], &[0x62, 0x09, 0x62, 0x07]);
        assert_eq!(&new[at + 4..at + 11], b"gpusnap");
        assert_eq!(&new[at + 11..], &CRIU_411_INVENTORY[at + 2..]);
        // Adding it again changes nothing; a second plugin is appended after it.
        assert_eq!(with_inventory_plugin(&new, "gpusnap").unwrap(), new);
        let two = with_inventory_plugin(&new, "cuda_plugin").unwrap();
        assert_eq!(inventory_plugins(&two).unwrap(), ["gpusnap", "cuda_plugin"]);
    }

    #[test]
    fn adds_plugins_entry_when_missing() {
        // Just img_version = 2.
        let img = [0x16, 0x31, 0x31, 0x58, 0x02, 0x00, 0x00, 0x00, 0x08, 0x02];
        let new = with_inventory_plugin(&img, "gpusnap").unwrap();
        let mut expected = img[..8].to_vec();
        expected[4] = 2 + 11;
        expected.extend([0x08, 0x02, 0x62, 0x09, 0x62, 0x07]);
        expected.extend(b"gpusnap");
        assert_eq!(new, expected);
        assert_eq!(inventory_plugins(&new).unwrap(), ["gpusnap"]);
    }

    #[test]
    fn refuses_foreign_or_damaged_files() {
        let mut bad_magic = CRIU_411_INVENTORY.to_vec();
        bad_magic[0] ^= 1;
        assert!(with_inventory_plugin(&bad_magic, "gpusnap").is_err());
        let short = &CRIU_411_INVENTORY[..CRIU_411_INVENTORY.len() - 1];
        assert!(inventory_plugins(short).is_err());
        let mut bad_len = CRIU_411_INVENTORY.to_vec();
        bad_len[8 + 5] = 0x7f; // root_ids claims more bytes than there are
        assert!(inventory_plugins(&bad_len).is_err());
    }

    #[test]
    fn varints_round_trip() {
        for v in [0, 1, 127, 128, 300, 1 << 35, u64::MAX] {
            let mut b = Vec::new();
            write_varint(&mut b, v);
            let mut pos = 0;
            assert_eq!(read_varint(&b, &mut pos).unwrap(), v);
            assert_eq!(pos, b.len());
        }
    }
}
