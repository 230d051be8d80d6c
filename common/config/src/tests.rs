use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A file in a fresh temporary directory, removed on drop.
struct TempFile {
    dir: PathBuf,
    path: PathBuf,
}

impl TempFile {
    fn new(contents: &str) -> TempFile {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "gpusnap-config-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gpusnap.conf");
        std::fs::write(&path, contents).unwrap();
        TempFile { dir, path }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn from_file(contents: &str) -> Result<Config, ConfigError> {
    let f = TempFile::new(contents);
    load_from(Some(&f.path), true, &[])
}

fn from_env(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
    load_from(None, false, &env(pairs))
}

const UUID_A: &str = "GPU-0a1b2c3d-0000-1111-2222-333344445555";
const HEX_A: &str = "0a1b2c3d000011112222333344445555";
const UUID_B: &str = "GPU-9F8E7D6C-AAAA-BBBB-CCCC-DDDDEEEEFFFF";
const HEX_B: &str = "9f8e7d6caaaabbbbccccddddeeeeffff";

#[test]
fn defaults() {
    let c = Config::default();
    assert_eq!(c.mode, Mode::Auto);
    assert_eq!((c.writer_threads, c.reader_threads), (0, 0));
    assert_eq!((c.staging_slot_mib, c.staging_slots), (32, 16));
    assert_eq!(c.copy_streams, 4);
    assert_eq!(c.compress, Compress::Off);
    assert_eq!(c.verify_before_restore, Verify::Auto);
    assert!(c.incremental);
    assert!(!c.durable);
    assert_eq!(c.agent_timeout_ms, 30_000);
    assert_eq!(c.lock_timeout_ms, 0);
    assert_eq!(c.lock_timeout(), None);
    assert!(c.device_map.is_empty());
    assert_eq!(c.log_level, None);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(c.effective_writer_threads(), cpus.min(16));
    assert_eq!(c.effective_reader_threads(), cpus.min(16));
    assert_eq!(c.staging_slot_bytes(), 32 << 20);
}

#[test]
fn no_file_and_no_env_gives_defaults() {
    assert_eq!(load_from(None, false, &[]).unwrap(), Config::default());
}

#[test]
fn missing_default_file_is_fine() {
    let missing = std::env::temp_dir().join("gpusnap-config-test-does-not-exist.conf");
    assert_eq!(
        load_from(Some(&missing), false, &[]).unwrap(),
        Config::default()
    );
}

#[test]
fn missing_named_file_is_an_error() {
    let missing = std::env::temp_dir().join("gpusnap-config-test-does-not-exist.conf");
    let err = load_from(Some(&missing), true, &[]).unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }), "{err}");
    assert!(err.to_string().contains("does-not-exist"), "{err}");
}

#[test]
fn config_path_follows_gpusnap_config() {
    assert_eq!(config_path(None), (PathBuf::from(DEFAULT_PATH), false));
    assert_eq!(
        config_path(Some("/x/y.conf")),
        (PathBuf::from("/x/y.conf"), true)
    );
}

#[test]
fn parses_every_key_from_file() {
    let c = from_file(&format!(
        r#"
mode = "transparent"
writer_threads = 8
reader_threads = 64
staging_slot_mib = 1024
staging_slots = 2
copy_streams = 16
compress = "zstd"
verify_before_restore = false
incremental = false
durable = true
handover = false
async_leave_running = true
async_snapshot_share = 90
keeper = "/opt/gpusnap/gpusnap-keeper"
agent_timeout_ms = 100
lock_timeout_ms = 3600000
device_map = "{UUID_A}={UUID_B}"
allow_other_kernel_driver = true
log_level = "debug"
"#
    ))
    .unwrap();
    let expected = Config {
        mode: Mode::Transparent,
        writer_threads: 8,
        reader_threads: 64,
        staging_slot_mib: 1024,
        staging_slots: 2,
        copy_streams: 16,
        compress: Compress::Zstd,
        verify_before_restore: Verify::Off,
        incremental: false,
        durable: true,
        handover: false,
        async_leave_running: true,
        async_snapshot_share: 90,
        keeper: "/opt/gpusnap/gpusnap-keeper".to_owned(),
        agent_timeout_ms: 100,
        lock_timeout_ms: 3_600_000,
        device_map: vec![(HEX_A.to_owned(), HEX_B.to_owned())],
        allow_other_kernel_driver: true,
        log_level: Some(LogLevel::Debug),
    };
    assert_eq!(c, expected);
    assert_eq!(c.effective_writer_threads(), 8);
    assert_eq!(c.lock_timeout(), Some(Duration::from_secs(3600)));
    assert_eq!(c.mapped_device(UUID_A), Some(HEX_B));
    assert_eq!(c.mapped_device(HEX_B), None);
}

#[test]
fn example_file_has_every_key_with_its_default() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("gpusnap.conf.example");
    let text = std::fs::read_to_string(&path).unwrap();
    for key in key_names() {
        assert!(
            text.lines().any(|l| l.starts_with(&format!("{key} = "))),
            "{key} missing from the example"
        );
    }
    assert_eq!(
        load_from(Some(&path), true, &[]).unwrap(),
        Config::default()
    );
}

#[test]
fn env_overrides_file() {
    let f = TempFile::new("writer_threads = 4\ncompress = \"zstd\"\nmode = \"off\"\n");
    let c = load_from(
        Some(&f.path),
        true,
        &env(&[
            ("GPUSNAP_WRITER_THREADS", "12"),
            ("GPUSNAP_MODE", "auto"),
            ("PATH", "/usr/bin"),
        ]),
    )
    .unwrap();
    assert_eq!(c.writer_threads, 12);
    assert_eq!(c.mode, Mode::Auto);
    assert_eq!(
        c.compress,
        Compress::Zstd,
        "file value kept where env is silent"
    );
}

#[test]
fn later_env_entry_wins() {
    let c = from_env(&[("GPUSNAP_COPY_STREAMS", "2"), ("GPUSNAP_COPY_STREAMS", "3")]).unwrap();
    assert_eq!(c.copy_streams, 3);
}

#[test]
fn env_value_forms() {
    let c = from_env(&[
        ("GPUSNAP_VERIFY_BEFORE_RESTORE", "0"),
        ("GPUSNAP_INCREMENTAL", "false"),
        ("GPUSNAP_DURABLE", "1"),
        ("GPUSNAP_STAGING_SLOTS", "64"),
        ("GPUSNAP_LOG_LEVEL", "warn"),
        ("GPUSNAP_DEVICE_MAP", &format!("{HEX_A}={UUID_B},")),
    ])
    .unwrap();
    assert_eq!(c.verify_before_restore, Verify::Off);
    assert!(!c.incremental);
    assert!(c.durable);
    assert_eq!(c.staging_slots, 64);
    assert_eq!(c.log_level, Some(LogLevel::Warn));
    assert_eq!(c.device_map, vec![(HEX_A.to_owned(), HEX_B.to_owned())]);
    for (spelling, value) in [("1", true), ("true", true), ("0", false), ("false", false)] {
        let c = from_env(&[("GPUSNAP_DURABLE", spelling)]).unwrap();
        assert_eq!(c.durable, value, "{spelling}");
    }
    assert_eq!(
        from_env(&[("GPUSNAP_LOCK_TIMEOUT_MS", "0")])
            .unwrap()
            .lock_timeout_ms,
        0
    );
}

/// The environment is read as strictly as the file: the spellings the file refuses are refused
/// from the environment too, naming the variable and what is accepted. (These were once taken:
/// yes/no, on/off in any case, and integers with a sign or spaces.)
#[test]
fn env_values_are_as_strict_as_the_file() {
    for bad in [
        "yes", "no", "on", "off", "YES", "On", "TRUE", "True", "False", " 1", "1 ", " true", "",
        "01", "2", "-1",
    ] {
        let err = from_env(&[("GPUSNAP_DURABLE", bad)]).unwrap_err();
        assert_invalid(
            err,
            "environment variable GPUSNAP_DURABLE",
            "expected exactly one of true, false, 1, 0",
        );
    }
    for bad in [
        "+4", " 4", "4 ", "04", "4_000", "0x4", "-4", "4.0", "", "4e0",
    ] {
        let err = from_env(&[("GPUSNAP_WRITER_THREADS", bad)]).unwrap_err();
        let msg = err.to_string();
        assert_invalid(err, "environment variable GPUSNAP_WRITER_THREADS", "1..=64");
        assert!(msg.contains(&format!("{bad:?}")), "{msg}");
        assert!(
            msg.contains("decimal digits only (no sign, spaces"),
            "{msg}"
        );
    }
    // Digits that overflow are out of range, not wrapped.
    assert!(from_env(&[("GPUSNAP_AGENT_TIMEOUT_MS", "18446744073709552616")]).is_err());
    // Strings are taken as written, as in the file.
    for bad in [" auto", "auto ", "AUTO"] {
        let err = from_env(&[("GPUSNAP_MODE", bad)]).unwrap_err();
        assert_invalid(err, "environment variable GPUSNAP_MODE", "\"auto\"");
    }
    assert_invalid(
        from_file("mode = \" auto\"\n").unwrap_err(),
        "key `mode`",
        "\"auto\"",
    );
    assert!(from_env(&[("GPUSNAP_LOG_LEVEL", " ")]).is_err());
}

#[test]
fn allowlisted_and_config_env_vars_are_ignored() {
    let mut pairs = vec![("GPUSNAP_CONFIG", "/nonexistent")];
    pairs.extend(NON_CONFIG_ENV.iter().map(|v| (*v, "1")));
    assert_eq!(from_env(&pairs).unwrap(), Config::default());
}

#[test]
fn unknown_key_in_file() {
    let err = from_file("writer_thread = 4\n").unwrap_err();
    let ConfigError::UnknownKey { key, valid, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(key, "writer_thread");
    assert!(valid.contains("writer_threads"), "{valid}");
    let msg = err.to_string();
    assert!(
        msg.contains("gpusnap.conf") && msg.contains("writer_thread`"),
        "{msg}"
    );
}

#[test]
fn tables_in_file() {
    let err = from_file("[mode]\nx = 1\n").unwrap_err();
    assert!(matches!(err, ConfigError::Invalid { .. }), "{err}");
    let err = from_file("[extra]\nx = 1\n").unwrap_err();
    assert!(matches!(err, ConfigError::UnknownKey { .. }), "{err}");
}

#[test]
fn unknown_env_var() {
    let err = from_env(&[("GPUSNAP_WRITER_THREAD", "4")]).unwrap_err();
    let ConfigError::UnknownEnv { var, valid } = &err else {
        panic!("{err}");
    };
    assert_eq!(var, "GPUSNAP_WRITER_THREAD");
    assert!(valid.contains("GPUSNAP_WRITER_THREADS"), "{valid}");
    assert!(valid.contains("GPUSNAP_DURABLE"), "{valid}");
    assert!(valid.contains("GPUSNAP_CONFIG"), "{valid}");
    // Only what a user sets: not the build, test and script variables that are let through.
    for not_a_setting in NON_CONFIG_ENV
        .iter()
        .map(|v| v.to_string())
        .chain(NON_CONFIG_PREFIXES.iter().map(|p| format!("{p}*")))
    {
        assert!(
            !valid.contains(&not_a_setting),
            "{not_a_setting} in {valid}"
        );
    }
    // The variable must be the key uppercased exactly.
    let err = from_env(&[("GPUSNAP_writer_threads", "4")]).unwrap_err();
    assert!(matches!(err, ConfigError::UnknownEnv { .. }), "{err}");
}

#[test]
fn invalid_toml() {
    let err = from_file("# comment\nmode = \n").unwrap_err();
    assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("line 2, column 8: "), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
}

fn assert_invalid(err: ConfigError, where_: &str, allowed_part: &str) {
    let msg = err.to_string();
    assert!(matches!(err, ConfigError::Invalid { .. }), "{msg}");
    assert!(msg.contains(where_), "{msg} should name {where_}");
    assert!(
        msg.contains(allowed_part),
        "{msg} should say {allowed_part}"
    );
}

#[test]
fn out_of_range_values() {
    let cases: &[(&str, &str, &str)] = &[
        ("writer_threads", "65", "1..=64"),
        ("reader_threads", "-1", "1..=64"),
        ("staging_slot_mib", "0", "1..=1024"),
        ("staging_slot_mib", "1025", "1..=1024"),
        ("staging_slots", "1", "2..=256"),
        ("staging_slots", "257", "2..=256"),
        ("copy_streams", "0", "1..=16"),
        ("copy_streams", "17", "1..=16"),
        ("agent_timeout_ms", "99", "100..=600000"),
        ("agent_timeout_ms", "600001", "100..=600000"),
        ("lock_timeout_ms", "3600001", "1..=3600000"),
    ];
    for (key, value, allowed) in cases {
        let err = from_file(&format!("{key} = {value}\n")).unwrap_err();
        assert_invalid(err, &format!("key `{key}` in "), allowed);
        let var = format!("GPUSNAP_{}", key.to_uppercase());
        let err = from_env(&[(&var, value)]).unwrap_err();
        assert_invalid(err, &format!("environment variable {var}"), allowed);
    }
    // The edges are accepted.
    let c = from_env(&[
        ("GPUSNAP_WRITER_THREADS", "64"),
        ("GPUSNAP_READER_THREADS", "1"),
        ("GPUSNAP_AGENT_TIMEOUT_MS", "600000"),
    ])
    .unwrap();
    assert_eq!((c.writer_threads, c.reader_threads), (64, 1));
}

#[test]
fn wrong_types() {
    assert_invalid(
        from_file("writer_threads = \"8\"\n").unwrap_err(),
        "writer_threads",
        "1..=64",
    );
    assert_invalid(
        from_file("verify_before_restore = \"yes\"\n").unwrap_err(),
        "verify_before_restore",
        "\"auto\", \"host\", \"off\"",
    );
    for (text, want) in [
        ("\"auto\"", Verify::Auto),
        ("\"host\"", Verify::Host),
        ("\"off\"", Verify::Off),
        ("true", Verify::Host),
        ("false", Verify::Off),
    ] {
        let c = from_file(&format!("verify_before_restore = {text}\n")).unwrap();
        assert_eq!(c.verify_before_restore, want, "{text}");
    }
    assert_invalid(
        from_file("incremental = 1\n").unwrap_err(),
        "incremental",
        "true or false",
    );
    assert_invalid(
        from_env(&[("GPUSNAP_INCREMENTAL", "sometimes")]).unwrap_err(),
        "GPUSNAP_INCREMENTAL",
        "true, false, 1, 0",
    );
    assert_invalid(
        from_file("durable = \"yes\"\n").unwrap_err(),
        "durable",
        "true or false",
    );
    assert_invalid(
        from_env(&[("GPUSNAP_DURABLE", "2")]).unwrap_err(),
        "GPUSNAP_DURABLE",
        "true, false, 1, 0",
    );
    assert_invalid(
        from_env(&[("GPUSNAP_VERIFY_BEFORE_RESTORE", "maybe")]).unwrap_err(),
        "GPUSNAP_VERIFY_BEFORE_RESTORE",
        "\"auto\", \"host\", \"off\"",
    );
    assert_invalid(
        from_file("mode = 1\n").unwrap_err(),
        "mode",
        "\"transparent\"",
    );
    assert_invalid(
        from_env(&[("GPUSNAP_WRITER_THREADS", "8x")]).unwrap_err(),
        "GPUSNAP_WRITER_THREADS",
        "1..=64",
    );
}

#[test]
fn bad_enum_values() {
    assert_invalid(
        from_file("mode = \"split\"\n").unwrap_err(),
        "key `mode`",
        "\"auto\", \"transparent\", \"off\"",
    );
    assert_invalid(
        from_env(&[("GPUSNAP_COMPRESS", "lz4")]).unwrap_err(),
        "GPUSNAP_COMPRESS",
        "\"off\", \"zstd\"",
    );
    assert_invalid(
        from_file("log_level = \"trace\"\n").unwrap_err(),
        "key `log_level`",
        "\"debug\"",
    );
    // Enum values are case-sensitive, as TOML keys are.
    assert!(from_env(&[("GPUSNAP_MODE", "Auto")]).is_err());
}

#[test]
fn device_map_parsing() {
    let two = format!(" {UUID_A} = {HEX_B} , {HEX_B}={UUID_A} ");
    assert_eq!(
        device_map::parse(&two).unwrap(),
        vec![
            (HEX_A.to_owned(), HEX_B.to_owned()),
            (HEX_B.to_owned(), HEX_A.to_owned())
        ]
    );
    assert_eq!(device_map::parse("").unwrap(), vec![]);
    assert_eq!(device_map::parse(" , ").unwrap(), vec![]);

    let bad = [
        UUID_A.to_owned(),                     // no '='
        format!("{UUID_A}={UUID_B}={UUID_B}"), // two '='
        format!("{UUID_A}="),                  // empty new
        "GPU-0a1b2c3d-0000-1111-2222-33334444555=0a1b2c3d000011112222333344445555".to_owned(),
        "GPU-0a1b2c3d00001111-2222-333344445555=0a1b2c3d000011112222333344445555".to_owned(),
        "0a1b2c3d-0000-1111-2222-333344445555=0a1b2c3d000011112222333344445556".to_owned(),
        "MIG-0a1b2c3d-0000-1111-2222-333344445555=0a1b2c3d000011112222333344445556".to_owned(),
        "0a1b2c3d00001111222233334444555g=0a1b2c3d000011112222333344445556".to_owned(),
        format!("{UUID_A}={UUID_B},{HEX_A}={HEX_A}"), // old mapped twice
        format!("{UUID_A}={UUID_B},{HEX_B}={HEX_B}"), // two onto one
    ];
    for text in &bad {
        assert!(device_map::parse(text).is_err(), "accepted {text:?}");
    }

    let err = from_file("device_map = \"GPU-1234=GPU-5678\"\n").unwrap_err();
    assert_invalid(err, "key `device_map`", "GPU-xxxxxxxx-xxxx");
    let err = from_file("device_map = [\"a\"]\n").unwrap_err();
    assert_invalid(err, "key `device_map`", "OLD=NEW");
}

#[test]
fn normalise_uuid_forms() {
    assert_eq!(normalise_uuid(UUID_A).unwrap(), HEX_A);
    assert_eq!(normalise_uuid(UUID_B).unwrap(), HEX_B);
    assert_eq!(normalise_uuid(&HEX_B.to_uppercase()).unwrap(), HEX_B);
    assert!(normalise_uuid("").is_err());
    assert!(normalise_uuid("GPU-").is_err());
}

#[test]
fn normalise_uuid_takes_only_the_two_written_forms() {
    for ok in [
        "GPU-0a1b2c3d-0000-1111-2222-333344445555",
        "GPU-0A1B2C3D-0000-1111-2222-333344445555",
        "0a1b2c3d000011112222333344445555",
        "0A1B2C3D000011112222333344445555",
    ] {
        assert_eq!(normalise_uuid(ok).as_deref(), Ok(HEX_A), "{ok}");
    }
    for bad in [
        "gpu-0a1b2c3d-0000-1111-2222-333344445555",
        "GPU-0a1b2c3d000011112222333344445555",
        "GPU-0a1b2c3d-0000-1111-2222-33334444-5555",
        "GPU-0a1b2c3d--0000-1111-2222-333344445555",
        "GPU-0a1b2c3d-0000-1111-2222-333344445555-",
        "0a1b2c3d-0000-1111-2222-333344445555",
        "-0a1b2c3d000011112222333344445555",
        "+a1b2c3d000011112222333344445555",
        " 0a1b2c3d000011112222333344445555",
    ] {
        let e = normalise_uuid(bad).unwrap_err();
        assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
    }
}

#[test]
fn a_bad_device_map_uuid_is_refused_at_load_naming_key_and_text() {
    let bad = "GPU-0a1b2c3d-0000-1111-2222-33334444555g";
    let err = from_file(&format!("device_map = \"{UUID_A}={bad}\"\n")).unwrap_err();
    assert_invalid(err, "key `device_map`", &format!("got `{bad}`"));
    let err = from_env(&[("GPUSNAP_DEVICE_MAP", &format!("{bad}={HEX_B}"))]).unwrap_err();
    assert_invalid(err, "GPUSNAP_DEVICE_MAP", &format!("got `{bad}`"));
}

#[test]
fn log_level_can_be_cleared_from_env() {
    let f = TempFile::new("log_level = \"info\"\n");
    let c = load_from(Some(&f.path), true, &env(&[("GPUSNAP_LOG_LEVEL", "")])).unwrap();
    assert_eq!(c.log_level, None);
    assert_eq!(LogLevel::Info.to_level_filter(), log::LevelFilter::Info);
}

#[test]
fn describe_lists_every_key_on_one_line() {
    let mut c = Config::default();
    let line = c.describe();
    assert!(!line.contains('\n'));
    for key in key_names() {
        assert!(line.contains(&format!("{key}=")), "{key} missing in {line}");
    }
    assert!(line.contains("mode=auto"), "{line}");
    assert!(line.contains("(auto)"), "{line}");
    assert!(line.contains("lock_timeout_ms=0 (criu)"), "{line}");
    assert!(line.contains("device_map=none"), "{line}");
    assert!(line.contains(" durable=false "), "{line}");
    assert!(line.ends_with("log_level=criu"), "{line}");

    c.writer_threads = 3;
    c.device_map = vec![(HEX_A.to_owned(), HEX_B.to_owned())];
    c.log_level = Some(LogLevel::Warn);
    let line = c.describe();
    assert!(line.contains("writer_threads=3 "), "{line}");
    assert!(
        line.contains(&format!("device_map={HEX_A}={HEX_B}")),
        "{line}"
    );
    assert!(line.ends_with("log_level=warn"), "{line}");
}

/// `GPUSNAP_FSYNC` was once listed as "read by the image writer", but nothing read it; it is
/// refused like any unknown variable, so nobody believes it makes dumps durable. The setting
/// that does is `durable` (`GPUSNAP_DURABLE`).
#[test]
fn gpusnap_fsync_is_not_a_setting() {
    let err = from_env(&[("GPUSNAP_FSYNC", "1")]).unwrap_err();
    let ConfigError::UnknownEnv { var, valid } = &err else {
        panic!("{err}");
    };
    assert_eq!(var, "GPUSNAP_FSYNC");
    assert!(!valid.contains("GPUSNAP_FSYNC"), "{valid}");
    assert!(valid.contains("GPUSNAP_DURABLE"), "{valid}");
}

/// `load` with `GPUSNAP_CONFIG=path` and no other variable, in a thread, so that a regression
/// that blocks (a FIFO) or reads forever (`/dev/zero`) fails the test instead of hanging it.
fn load_named_within(path: &Path, limit: Duration) -> Result<Config, ConfigError> {
    let named = path.to_str().unwrap().to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (file, required) = config_path(Some(&named));
        let _ = tx.send(load_from(Some(&file), required, &[]));
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("loading {} took more than {limit:?}", path.display()))
}

fn assert_not_regular(err: ConfigError, path: &Path, what: &str) {
    let msg = err.to_string();
    assert!(matches!(err, ConfigError::NotRegular { .. }), "{msg}");
    assert!(
        msg.contains(&format!("{} is {what}, not a regular file", path.display())),
        "{msg} should say {what}"
    );
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let f = TempFile::new("");
    let fifo = f.dir.join("fifo.conf");
    let status = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(status.success());
    let err = load_named_within(&fifo, Duration::from_secs(10)).unwrap_err();
    assert_not_regular(err, &fifo, "a FIFO (named pipe)");
}

#[test]
fn dev_zero_is_refused_without_reading_it() {
    let zero = Path::new("/dev/zero");
    let err = load_named_within(zero, Duration::from_secs(10)).unwrap_err();
    assert_not_regular(err, zero, "a character device");
}

#[test]
fn a_directory_is_refused() {
    let f = TempFile::new("");
    let err = load_named_within(&f.dir, Duration::from_secs(10)).unwrap_err();
    assert_not_regular(err, &f.dir, "a directory");
}

/// The documented way to ignore the default file keeps working, directly or through a symlink.
#[test]
fn dev_null_reads_as_empty() {
    let null = Path::new("/dev/null");
    assert_eq!(
        load_named_within(null, Duration::from_secs(10)).unwrap(),
        Config::default()
    );
    let f = TempFile::new("");
    let link = f.dir.join("null.conf");
    std::os::unix::fs::symlink(null, &link).unwrap();
    assert_eq!(
        load_from(Some(&link), true, &[]).unwrap(),
        Config::default()
    );
}

/// A symlink to a regular file is read: /etc files are often links.
#[test]
fn a_symlink_to_a_regular_file_is_read() {
    let f = TempFile::new("writer_threads = 3\n");
    let link = f.dir.join("link.conf");
    std::os::unix::fs::symlink(&f.path, &link).unwrap();
    assert_eq!(load_from(Some(&link), true, &[]).unwrap().writer_threads, 3);
}

#[test]
fn a_file_over_the_cap_is_refused() {
    // Exactly at the cap: read (a comment padded to the size).
    let mut text = "writer_threads = 2\n#".to_owned();
    text.push_str(&"x".repeat(MAX_FILE_BYTES as usize - text.len() - 1));
    text.push('\n');
    assert_eq!(text.len() as u64, MAX_FILE_BYTES);
    let f = TempFile::new(&text);
    assert_eq!(
        load_from(Some(&f.path), true, &[]).unwrap().writer_threads,
        2
    );
    // One byte more: refused, naming the file and the limit.
    text.push('\n');
    let f = TempFile::new(&text);
    let err = load_from(Some(&f.path), true, &[]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ConfigError::TooLarge { .. }), "{msg}");
    assert!(
        msg.contains(&format!("{} is larger than 1024 KiB", f.path.display())),
        "{msg}"
    );
    // Also when the default file is the one too large: only a missing default is "defaults".
    assert!(load_from(Some(&f.path), false, &[]).is_err());
}

#[test]
fn a_file_that_is_not_utf8_is_refused() {
    let f = TempFile::new("");
    std::fs::write(&f.path, b"mode = \"auto\"\n\xff\n").unwrap();
    let msg = load_from(Some(&f.path), true, &[]).unwrap_err().to_string();
    assert!(
        msg.contains("gpusnap.conf") && msg.contains("not valid UTF-8"),
        "{msg}"
    );
}

#[test]
fn compress_takes_auto_and_names_the_choices() {
    let c = from_env(&[("GPUSNAP_COMPRESS", "auto")]).unwrap();
    assert_eq!(c.compress, Compress::Auto);
    assert!(c.describe().contains("compress=auto"));
    let e = from_env(&[("GPUSNAP_COMPRESS", "lz4")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"off\", \"zstd\", \"auto\""), "{e}");
}

/// Two bad keys in the file and a bad variable: all three in one error, in the order found,
/// each naming where it came from.
#[test]
fn every_problem_is_reported_at_once() {
    let f = TempFile::new("writer_thread = 4\nmode = \"fast\"\nstaging_slots = 8\n");
    let path = f.path.clone();
    let env = env(&[("GPUSNAP_DURABEL", "1")]);
    let err = load_from(Some(&path), true, &env).unwrap_err();
    let ConfigError::Several(all) = &err else {
        panic!("one problem only: {err}");
    };
    assert_eq!(all.len(), 3, "{err}");
    assert_eq!(err.problems().len(), 3);
    let msg = err.to_string();
    assert!(msg.starts_with("3 configuration problems: (1) "), "{msg}");
    for needle in ["writer_thread`", "key `mode`", "GPUSNAP_DURABEL", "(3) "] {
        assert!(msg.contains(needle), "{needle} missing: {msg}");
    }
    // One problem is itself, not a list of one.
    let err = load_from(Some(&path), true, &[]).unwrap_err();
    assert_eq!(err.problems().len(), 2);
    std::fs::write(&path, "staging_slots = 8\n").unwrap();
    let err = load_from(Some(&path), true, &env).unwrap_err();
    assert!(matches!(err, ConfigError::UnknownEnv { .. }), "{err}");
}
