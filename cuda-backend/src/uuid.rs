//! A GPU's UUID, in every form gpusnap meets it: the driver's 16 bytes, the 32 hex digits of
//! gpusnap's images, config and logs, and NVML's `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.

use cudarc::driver::sys::CUuuid;
use std::ffi::c_char;
use std::fmt;
use std::str::FromStr;

/// A GPU's UUID: the 16 bytes that `cuDeviceGetUuid_v2` reports and that
/// `cuCheckpointProcessRestore`'s GPU pairs name.
///
/// [`Display`](fmt::Display) writes 32 lowercase hex digits (the form in images, config and
/// logs); [`Self::to_nvml_string`] writes the dashed form NVML and `nvidia-smi` use.
/// [`FromStr`] reads either, and more loosely (see there).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuUuid([u8; 16]);

impl GpuUuid {
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    pub const fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (lowercase), as NVML's
    /// `nvmlDeviceGetHandleByUUID` wants it and `nvidia-smi -L` prints it.
    pub fn to_nvml_string(&self) -> String {
        let hex = self.to_string();
        format!(
            "GPU-{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        )
    }
}

impl From<[u8; 16]> for GpuUuid {
    fn from(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }
}

impl From<GpuUuid> for [u8; 16] {
    fn from(uuid: GpuUuid) -> Self {
        uuid.0
    }
}

// CUuuid holds its bytes as `c_char`, signed on x86_64 and unsigned on aarch64; the byte-wise
// `from_ne_bytes`/`to_ne_bytes` keep the bits either way.
impl From<CUuuid> for GpuUuid {
    fn from(raw: CUuuid) -> Self {
        Self(raw.bytes.map(|b| b.to_ne_bytes()[0]))
    }
}

impl From<GpuUuid> for CUuuid {
    fn from(uuid: GpuUuid) -> Self {
        CUuuid {
            bytes: uuid.0.map(|b| c_char::from_ne_bytes([b])),
        }
    }
}

impl fmt::Display for GpuUuid {
    /// 32 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GpuUuid({self})")
    }
}

/// Text that [`GpuUuid::from_str`] does not take, quoted in the message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not a GPU UUID (32 hex digits, dashes allowed, optionally after `GPU-`)")]
pub struct ParseGpuUuidError {
    text: String,
}

impl ParseGpuUuidError {
    /// The text that was refused.
    pub fn text(&self) -> &str {
        &self.text
    }
}

impl FromStr for GpuUuid {
    type Err = ParseGpuUuidError;

    /// 32 hex digits of either case, optionally after one `GPU-` (upper case, as NVML writes
    /// it); dashes anywhere are skipped, so both `GPU-0123abcd-4567-89ef-0123-456789abcdef` and
    /// `0123abcd456789ef0123456789abcdef` read. Nothing else: no spaces, no sign, no other
    /// prefix (not even `MIG-`: a MIG instance is not a GPU the driver can restore onto).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || ParseGpuUuidError {
            text: text.to_owned(),
        };
        let mut digits = text
            .strip_prefix("GPU-")
            .unwrap_or(text)
            .chars()
            .filter(|&c| c != '-');
        let mut bytes = [0u8; 16];
        for byte in &mut bytes {
            let mut digit = || digits.next().and_then(|c| c.to_digit(16)).ok_or_else(bad);
            let (high, low) = (digit()?, digit()?);
            // Both are below 16, so the byte cannot overflow.
            *byte = ((high << 4) | low) as u8;
        }
        if digits.next().is_some() {
            return Err(bad());
        }
        Ok(Self(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    const BYTES: [u8; 16] = [
        0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd,
        0xef,
    ];
    const HEX: &str = "0123abcd456789ef0123456789abcdef";
    const NVML: &str = "GPU-0123abcd-4567-89ef-0123-456789abcdef";

    #[test]
    fn cuuuid_is_16_plain_bytes() {
        // cuda.h: `typedef struct CUuuid_st { char bytes[16]; } CUuuid;`
        assert_eq!(size_of::<CUuuid>(), 16);
        assert_eq!(align_of::<CUuuid>(), 1);
        assert_eq!(offset_of!(CUuuid, bytes), 0);
        assert_eq!(size_of::<GpuUuid>(), 16);
    }

    #[test]
    fn written_forms() {
        let u = GpuUuid::from_bytes(BYTES);
        assert_eq!(u.to_string(), HEX);
        assert_eq!(u.to_nvml_string(), NVML);
        assert_eq!(format!("{u:?}"), format!("GpuUuid({HEX})"));
        assert_eq!(GpuUuid::from_bytes([0; 16]).to_string(), "0".repeat(32));
    }

    #[test]
    fn driver_bytes_round_trip_with_the_high_bit_set() {
        let u = GpuUuid::from_bytes(BYTES);
        let raw = CUuuid::from(u);
        assert_eq!(raw.bytes[2], c_char::from_ne_bytes([0xab]));
        assert_eq!(GpuUuid::from(raw), u);
        assert_eq!(GpuUuid::from(raw).to_bytes(), BYTES);
        assert_eq!(<[u8; 16]>::from(GpuUuid::from(BYTES)), BYTES);
    }

    #[test]
    fn every_spelling_the_plugin_accepted_parses() {
        let u = GpuUuid::from_bytes(BYTES);
        for text in [
            HEX,
            NVML,
            &HEX.to_uppercase(),
            "GPU-0123ABCD-4567-89EF-0123-456789ABCDEF",
            "0123abcd-4567-89ef-0123-456789abcdef",
            "GPU-0123abcd456789ef0123456789abcdef",
            "0-1-23abcd456789ef0123456789abcdef--",
        ] {
            assert_eq!(text.parse::<GpuUuid>(), Ok(u), "{text}");
        }
    }

    #[test]
    fn other_text_is_refused_naming_it() {
        for text in [
            "",
            "GPU-",
            "GPU-12",
            "zz23abcd456789ef0123456789abcdef",
            "0123abcd456789ef0123456789abcde",
            "0123abcd456789ef0123456789abcdef0",
            " 0123abcd456789ef0123456789abcdef",
            "gpu-0123abcd-4567-89ef-0123-456789abcdef",
            "MIG-0123abcd-4567-89ef-0123-456789abcdef",
            "GPU-GPU-0123abcd456789ef0123456789abcdef",
            "+123abcd456789ef0123456789abcdef",
            "0123abcd456789ef0123456789abcdeé",
        ] {
            let e = text.parse::<GpuUuid>().unwrap_err();
            assert_eq!(e.text(), text);
            assert!(e.to_string().contains(&format!("`{text}`")), "{e}");
        }
    }
}
