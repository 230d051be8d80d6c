"""Tests of the floor's harness code (bench/bench.py, bench/report.py, gpu/ring_probe.cu) without
a GPU: python3 gpu/test_floor.py (scripts/test.sh runs it with the other gpu/test_*.py)

- bench.ring_floor against gpu/ring_probe.cu built as its host mock (g++ -DRING_PROBE_HOST_MOCK;
  skipped where g++ is missing): two runs parsed, the second kept with the first's rates, a
  corrupted file (the mock's RING_PROBE_MOCK_CORRUPT) refused as no floor;
- bench.floor_of on the split record of the H200 floor run (bench/results/floor-h200.jsonl) with
  a ring-probe record: the formula by hand;
- report.py renders the ring probe's Floor section, and an old run (tmpfs probe) as before.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "bench"))
sys.path.insert(0, HERE)
import bench  # noqa: E402
import report  # noqa: E402

SHAPE = {"slots": 4, "slot_mib": 1, "streams": 3, "threads": 5}


class Log:
    def __init__(self):
        self.lines = []

    def __call__(self, *parts):
        self.lines.append(" ".join(str(p) for p in parts))

    def block(self, title, text, max_lines=None):
        self.lines.append(title)
        self.lines.extend(text.splitlines())


def h200_floor_run():
    with open(os.path.join(REPO, "bench", "results", "floor-h200.jsonl")) as f:
        recs = [json.loads(x) for x in f if x.strip()]
    return [r for r in recs if r.get("run") == "20261201T115446-481"]


@unittest.skipIf(shutil.which("g++") is None, "g++ missing")
class RingProbeMock(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ring-probe-test-")
        cls.binary = os.path.join(cls.tmp, "ring_probe")
        subprocess.run(["g++", "-O2", "-x", "c++", "-DRING_PROBE_HOST_MOCK", "-pthread", "-o", cls.binary,
                        os.path.join(REPO, "gpu", "ring_probe.cu")], check=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_two_runs_second_kept(self):
        images = os.path.join(self.tmp, "images")
        os.makedirs(images)
        pr, why = bench.ring_floor(self.binary, images, 0.05, SHAPE, Log())
        self.assertIsNone(why)
        self.assertEqual(pr["kind"], "ring-probe")
        self.assertEqual(pr["run"], 2)
        self.assertTrue(pr["verified"])
        self.assertTrue(pr["mock"])
        for k, v in SHAPE.items():
            self.assertEqual(pr[k], v)
        self.assertIn("first_write_gbps", pr)
        self.assertGreater(pr["write_gbps"], 0)
        self.assertEqual(pr["bytes"], int(0.05 * 2**30) // 8 * 8)
        self.assertEqual(os.listdir(images), [])  # the probe removed its files and its dir

    def test_corruption_is_no_floor(self):
        images = os.path.join(self.tmp, "images-bad")
        os.makedirs(images)
        os.environ["RING_PROBE_MOCK_CORRUPT"] = "1"
        try:
            pr, why = bench.ring_floor(self.binary, images, 0.02, SHAPE, Log())
        finally:
            del os.environ["RING_PROBE_MOCK_CORRUPT"]
        self.assertIsNone(pr)
        self.assertIn("rc 3", why)

    def test_missing_binary(self):
        pr, why = bench.ring_floor(os.path.join(self.tmp, "nope"), self.tmp, 1, SHAPE, Log())
        self.assertIsNone(pr)
        self.assertIn("missing", why)


class FloorFormula(unittest.TestCase):
    def test_floor_of_h200_record(self):
        recs = h200_floor_run()
        split = next(r for r in recs if r.get("path") == "split")
        pcie = next(r for r in recs if r.get("kind") == "pcie")
        probe = {"kind": "ring-probe", "gib": 16.0, "slots": 16, "slot_mib": 32, "streams": 4,
                 "threads": 16, "write_gbps": 16.0, "read_gbps": 20.0}
        f = bench.floor_of(split, pcie, probe)
        t = split["phases"]["processes"][0]["timings_s"]
        rt = split["phases"]["restore"]["processes"][0]["timings_s"]
        moved = 16 * 2**30
        criu_dump = split["dump_s"] - sum(t.values())
        criu_restore = split["restore_s"] - rt["total"]
        self.assertEqual(f["moved_bytes"], moved)
        self.assertAlmostEqual(f["floor_dump_s"], moved / 16e9 + t["control"] + criu_dump, places=3)
        self.assertAlmostEqual(f["floor_restore_s"], moved / 20e9 + rt["control"] + criu_restore, places=3)
        self.assertEqual(f["floor_probe"], "ring")
        self.assertEqual(f["floor_probe_params"],
                         {"gib": 16.0, "slots": 16, "slot_mib": 32, "streams": 4, "threads": 16})
        self.assertAlmostEqual(f["data_out_share_of_floor"], moved / t["data"] / 16e9, places=3)
        self.assertIn("data_out_share_of_pcie", f)
        # without PCIe numbers the floor stands, the PCIe shares do not
        g = bench.floor_of(split, None, probe)
        self.assertEqual(g["floor_dump_s"], f["floor_dump_s"])
        self.assertNotIn("data_out_share_of_pcie", g)
        self.assertEqual(bench.floor_of(split, pcie, {"write_gbps": None}), {})


class Report(unittest.TestCase):
    def test_ring_section(self):
        recs = [dict(r) for r in h200_floor_run() if r.get("kind") != "floor-probe"]
        run = recs[0]["run"]
        probe = {"run": run, "kind": "floor-probe", "probe": "ring", "gib": 16.0, "slots": 16,
                 "slot_mib": 32, "streams": 4, "threads": 16, "write_gbps": 16.1, "read_gbps": 21.7,
                 "first_write_gbps": 9.5, "first_read_gbps": 20.2, "verified": True}
        pcie = next(r for r in recs if r.get("kind") == "pcie")
        for r in recs:
            if r.get("path") == "split":
                for k in [k for k in r if k.startswith("floor_") or k.startswith("data_")]:
                    del r[k]
                r.update(bench.floor_of(r, pcie, probe))
        text = report.render(recs + [probe], run)
        self.assertIn("ring probe (`gpu/ring_probe.cu`)", text)
        self.assertIn("16.10 / 21.70 (9.50 / 20.20)", text)
        self.assertNotIn("probe is Python", text)
        self.assertNotIn("tmpfs alone", text)
        fail = {"run": run, "kind": "floor-probe", "probe": "ring", "gib": 64, "failed": "ring_probe timed out"}
        self.assertIn("no floor at 64 GiB: ring_probe timed out", report.render(recs + [probe, fail], run))

    def test_old_run_unchanged(self):
        recs = h200_floor_run()
        text = report.render(recs, recs[0]["run"])
        self.assertIn("`gpu/tmpfs_probe.py` at the same size", text)
        self.assertIn("| 16 | 29.60 / 18.21 | 1.397 | 2.03 | 1.45 |", text)


if __name__ == "__main__":
    unittest.main()
