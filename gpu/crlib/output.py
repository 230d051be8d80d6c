"""What a run writes: $OUT, its timestamped log, JSON-lines results, gzipped logs in
$OUT/logs.tar; and `start_run`, the common start of every GPU script."""

import datetime
import gzip
import io
import json
import os
import tarfile
import time
import traceback

from crlib import REPO
from crlib.criu import install_plugin
from crlib.machine import machine_info
from crlib.procs import set_subreaper

LOGS_TAR_LIMIT = 14 << 20  # $OUT files come back only up to 16 MiB each


def out_dir():
    d = os.environ.get("OUT") or os.path.join(REPO, "out")
    os.makedirs(d, exist_ok=True)
    return d


def iso_now():
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


class Log:
    """Appends timestamped lines to a file and echoes them to stdout."""

    def __init__(self, path):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.f = open(path, "a", buffering=1)
        self.t0 = time.time()

    def __call__(self, *parts):
        msg = " ".join(str(p) for p in parts)
        stamp = "%s +%7.2fs" % (time.strftime("%H:%M:%S"), time.time() - self.t0)
        for line in msg.splitlines() or [""]:
            text = "[%s] %s" % (stamp, line)
            self.f.write(text + "\n")
            print(text, flush=True)

    def block(self, title, text, max_lines=None):
        lines = text.splitlines()
        if max_lines is not None and len(lines) > max_lines:
            lines = ["... (%d lines cut)" % (len(lines) - max_lines)] + lines[-max_lines:]
        self("---- %s (%d lines)" % (title, len(lines)))
        for line in lines:
            self.f.write("    | " + line + "\n")
            print("    | " + line, flush=True)
        self("---- end %s" % title)

    def file_tail(self, title, path, n=30):
        try:
            with open(path, "r", errors="replace") as f:
                text = f.read()
        except OSError as e:
            self("(%s: cannot read %s: %s)" % (title, path, e))
            return
        self.block("%s: last %d lines of %s" % (title, n, path), text, max_lines=n)


def append_jsonl(paths, record):
    line = json.dumps(record, sort_keys=False)
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with open(p, "a") as f:
            f.write(line + "\n")


def archive_add(files, prefix, log=None):
    """Appends gzipped copies of `files` to $OUT/logs.tar under `prefix/`."""
    tar_path = os.path.join(out_dir(), "logs.tar")
    try:
        size = os.path.getsize(tar_path)
    except OSError:
        size = 0
    try:
        with tarfile.open(tar_path, "a") as tar:
            for p in files:
                if not p or not os.path.isfile(p):
                    continue
                with open(p, "rb") as f:
                    data = gzip.compress(f.read(), compresslevel=6)
                if size + len(data) > LOGS_TAR_LIMIT:
                    if log:
                        log("logs.tar would pass %d MiB; not adding %s" % (LOGS_TAR_LIMIT >> 20, p))
                    continue
                info = tarfile.TarInfo("%s/%s.gz" % (prefix, os.path.basename(p)))
                info.size = len(data)
                info.mtime = int(time.time())
                tar.addfile(info, io.BytesIO(data))
                size += len(data) + 1024
    except Exception as e:  # never let log collection fail a case
        if log:
            log("archive_add failed: %r" % (e,))


def result_files(out, name, harness_test):
    """Where a script's JSON lines go: $OUT/NAME.jsonl, and bench/results/NAME.jsonl unless the
    run is a harness test without a GPU (--mock, --device cpu), which is not a result."""
    files = [os.path.join(out, name + ".jsonl")]
    if not harness_test:
        files.append(os.path.join(REPO, "bench", "results", name + ".jsonl"))
    return files


def note_failure(rec, log, exc, expected=()):
    """Records a case's failure in rec["problems"]: an `expected` exception by its message, any
    other with its traceback in the log."""
    if isinstance(exc, expected):
        rec["problems"].append(str(exc))
        log("CASE ERROR: %s" % exc)
    else:
        tb = format_exc()
        rec["problems"].append("exception: " + tb.strip().splitlines()[-1])
        log.block("exception", tb)


def format_exc():
    return traceback.format_exc()


def start_run(log_name, headline, plugdir):
    """The common start of a GPU script: $OUT, its log ($OUT/LOG_NAME.log) with HEADLINE and
    this machine, this process made a child subreaper (restored processes are reparented to
    it), the plugin installed in PLUGDIR. Returns (out, log, machine_info)."""
    out = out_dir()
    log = Log(os.path.join(out, log_name + ".log"))
    log(headline)
    mi = machine_info()
    log("machine: %s" % mi)
    log("subreaper: %s" % set_subreaper())
    install_plugin(plugdir, log)
    return out, log, mi
