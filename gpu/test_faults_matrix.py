"""Unit tests of the kill-matrix's plan in gpu/faults.py (no GPU, no CRIU): its points are the
plugin's, every point runs once per path, and the transparent chain takes its restores' images
from the dumps of points it does not reach. Run: python3 -m unittest discover -s gpu -p 'test_*.py'"""

import os
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import faults  # noqa: E402

FAULT_RS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "common", "host", "src", "fault.rs")


class Points(unittest.TestCase):
    def test_points_are_the_plugins(self):
        with open(FAULT_RS) as f:
            text = f.read()
        body = text[text.index("pub const POINTS"):]
        body = body[:body.index("];")]
        self.assertEqual(re.findall(r'"([a-z-]+)"', body),
                         faults.KILL_POINTS + faults.STANDIN_ONLY_POINTS)

    def test_split_only_and_stopped_are_points(self):
        self.assertLessEqual(faults.SPLIT_ONLY_POINTS, set(faults.KILL_POINTS))
        self.assertLessEqual(faults.STOPPED_AT, set(faults.KILL_POINTS))
        self.assertLessEqual(faults.RUNS_ON_AT, set(faults.KILL_POINTS))

    def test_operation(self):
        self.assertEqual(faults.point_operation("dump-locked"), "dump")
        self.assertEqual(faults.point_operation("rollback-reload"), "dump -R")
        self.assertEqual(faults.point_operation("restore-data"), "restore")
        for p in faults.KILL_POINTS:
            self.assertIn(faults.point_operation(p), faults.MOCK_KILL_ACTION)

    def test_reached(self):
        self.assertTrue(all(faults.point_reached(p, "split") for p in faults.KILL_POINTS
                            if p not in faults.COPY_FIRST_ONLY_POINTS))
        self.assertFalse(faults.point_reached("rollback-reload", "split"))
        self.assertFalse(faults.point_reached("dump-released", "transparent"))
        self.assertTrue(faults.point_reached("restore-control", "transparent"))


class Order(unittest.TestCase):
    def test_every_point_once(self):
        for path in ("split", "transparent"):
            order = faults.matrix_order(path, faults.KILL_POINTS)
            self.assertEqual(sorted(order), sorted(faults.KILL_POINTS))

    def test_split(self):
        order = faults.matrix_order("split", faults.KILL_POINTS)
        self.assertEqual(order, faults.KILL_POINTS)  # plugin order: the restores come last

    def test_transparent(self):
        self.assertEqual(faults.matrix_order("transparent", faults.KILL_POINTS), [
            "dump-locked", "dump-checkpointed", "rollback-restored", "rollback-reload",
            "rollback-reclaimed", "dump-data-out", "restore-keeper-load", "dump-lent",
            "restore-keeper-loaded", "dump-released", "restore-handing-over", "dump-relocked",
            "restore-control", "dump-drained", "restore-unlocked", "dump-before-manifest",
            "restore-data"])

    def test_subset(self):
        self.assertEqual(faults.matrix_order("transparent", ["restore-data", "dump-locked"]),
                         ["dump-locked", "restore-data"])


class Estimate(unittest.TestCase):
    def test_transparent_restores_need_no_extra_dump(self):
        # each restore-side case finds the image of the unreached dump before it
        state = "none"
        for point in faults.matrix_order("transparent", faults.KILL_POINTS):
            if faults.point_operation(point) == "restore":
                self.assertEqual(state, "dumped", point)
            _, state = faults.matrix_step("transparent", point, state, 16)
        # as many restore-side points as unreached dumps: the chain ends with a restore, which
        # the transparent path does not reach (copy-first only), so the workload runs on
        self.assertEqual(state, "running")

    def test_steps(self):
        s, st = faults.matrix_step("transparent", "dump-released", "running", 16)
        self.assertEqual(st, "dumped")
        self.assertAlmostEqual(s, 1.1 * 16 + faults.CRIU_S)
        s, st = faults.matrix_step("split", "restore-control", "none", 16)
        self.assertEqual(st, "running")
        self.assertGreater(s, faults.START_S + 0.12 * 16)  # it starts and dumps a workload first

    def test_fits_one_call_at_16_gib(self):
        # the split path's matrix alone (the transparent one no longer fits with it: 28 cases,
        # ~500 s; run it as its own call with --paths transparent)
        n = len(faults.KILL_POINTS)
        plan = faults.matrix_plan(["split", "transparent"], faults.KILL_POINTS, 16)
        self.assertEqual(len(plan), 2 * n)
        self.assertEqual([p for p, _, _ in plan[:n]], ["split"] * n)
        split = sum(s for p, _, s in plan if p == "split")
        self.assertGreater(split, 100)
        self.assertLess(split, 300)

    def test_paths(self):
        plan = faults.matrix_plan(["transparent"], ["dump-locked"], 16)
        self.assertEqual([(p, q) for p, q, _ in plan], [("transparent", "dump-locked")])


if __name__ == "__main__":
    unittest.main()
