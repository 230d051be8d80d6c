"""Unit tests of the tick checker (crlib.ticklog), on the CPU: the GPU scripts judge every
checkpoint by it, and there it runs only on a GPU machine.

Run: python3 -m unittest discover -s gpu -p 'test_*.py' (scripts/test.sh does).
"""

import os
import subprocess
import sys
import tempfile
import time
import unittest

from crlib.ticklog import LCG_A, MASK64, STATE0, check_ticks, parse_workload_log

HERE = os.path.dirname(os.path.abspath(__file__))
REF = 0x0123456789ABCDEF


def ready_line(ref=REF):
    """A `ready` line as gpu/workload.cu writes it."""
    return ("ready pid 4242 gib 1 chunks 1 chunk_bytes 1073741824 total_bytes 1073741824 alloc "
            "driver ref 0x%016x state0 0x%016x interval_ms 100" % (ref, STATE0))


def tick_lines(n, first=0, interval_us=100000, state=None):
    """n correct `tick` lines from tick `first` on: what the workload writes when every step
    computed right (counter +1 per tick, state advanced by the LCG, sum equal to the reference).
    `state`: the state before tick `first`, if not the right one."""
    if state is None:
        state = STATE0
        for counter in range(1, first + 1):
            state = (state * LCG_A + counter) & MASK64
    lines = []
    for tick in range(first, first + n):
        counter = tick + 1
        state = (state * LCG_A + counter) & MASK64
        lines.append("tick %d counter %d state 0x%016x sum 0x%016x ok 1 err 0 us %d dt_us 900" % (
            tick, counter, state, REF, 1_700_000_000_000_000 + tick * interval_us))
    return lines


def with_word(line, key, value):
    """`line` with the value after `key` replaced."""
    words = line.split()
    words[words.index(key) + 1] = str(value)
    return " ".join(words)


def word(line, key):
    words = line.split()
    return words[words.index(key) + 1]


class TickLogTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "workload.log")

    def tearDown(self):
        self.dir.cleanup()

    def write(self, lines, tail=""):
        with open(self.path, "w") as f:
            f.write("".join(line + "\n" for line in lines) + tail)

    def check(self, lines, tail="", **kw):
        self.write(lines, tail)
        ready, ticks, errors = parse_workload_log(self.path)
        return check_ticks(ready, ticks, errors, **kw)

    def assertProblem(self, res, words):
        self.assertFalse(res["pass"], res)
        self.assertTrue(any(words in p for p in res["problems"]), res["problems"])

    def test_good_ticks_pass(self):
        res = self.check([ready_line()] + tick_lines(10), need_after=5)
        self.assertTrue(res["pass"], res["problems"])
        self.assertEqual(res["n_ticks"], 10)
        self.assertEqual(res["ticks_after"], 10)
        self.assertEqual(res["median_gap_s"], 0.1)

    def test_parse_reads_every_field(self):
        self.write([ready_line()] + tick_lines(2))
        ready, ticks, errors = parse_workload_log(self.path)
        self.assertEqual(int(ready["ref"], 16), REF)
        self.assertEqual(errors, [])
        self.assertEqual([t["tick"] for t in ticks], [0, 1])
        self.assertEqual(ticks[0]["counter"], 1)
        self.assertEqual(ticks[0]["state"], (STATE0 * LCG_A + 1) & MASK64)
        self.assertEqual(ticks[1]["sum"], REF)
        self.assertEqual((ticks[1]["ok"], ticks[1]["err"], ticks[1]["dt_us"]), (1, 0, 900))

    def test_wrong_checksum_fails_at_that_tick(self):
        lines = tick_lines(6)
        lines[3] = with_word(lines[3], "sum", "0x%016x" % (REF ^ 1))
        res = self.check([ready_line()] + lines)
        self.assertProblem(res, "line 3 (tick 3): sum %016x != reference %016x" % (REF ^ 1, REF))
        self.assertEqual(len(res["problems"]), 1, res["problems"])

    def test_a_tick_that_reports_a_cuda_error_fails(self):
        lines = tick_lines(4)
        lines[2] = with_word(with_word(lines[2], "ok", 0), "err", 700)
        res = self.check([ready_line()] + lines + ["error tick 2 where sum runtime 700 x: y"])
        self.assertProblem(res, "line 2 (tick 2): ok 0 err 700")
        self.assertProblem(res, "1 error lines, first: error tick 2")

    def test_a_state_that_went_astray_is_reported_once(self):
        # from tick 4 on the device state follows the LCG from a wrong value (lost device memory):
        # the checker resynchronises on it, so the fault is one problem, not one per tick
        wrong = 0xDEADBEEF
        lines = tick_lines(4) + tick_lines(4, first=4, state=wrong)
        res = self.check([ready_line()] + lines)
        self.assertProblem(res, "line 4 (tick 4): state %s" % word(lines[4], "state")[2:])
        self.assertEqual(len(res["problems"]), 1, res["problems"])

    def test_counter_reset_after_a_restore_fails(self):
        # the process came back with its device counter from the start: a restore lost the data
        res = self.check([ready_line()] + tick_lines(5) + tick_lines(3))
        self.assertProblem(res, "line 5 (tick 0): host tick 0, expected 5")
        self.assertProblem(res, "device counter 1, expected 6")

    def test_no_ticks(self):
        res = self.check([ready_line()], need_after=5)
        self.assertProblem(res, "only 0 ticks after index 0, need 5")
        self.assertIsNone(res["median_gap_s"])

    def test_no_log_at_all(self):
        ready, ticks, errors = parse_workload_log(os.path.join(self.dir.name, "missing.log"))
        self.assertEqual((ready, ticks, errors), (None, [], []))
        self.assertProblem(check_ticks(ready, ticks, errors), "no ready line")

    def test_ticks_after_the_dump_are_counted_from_after_index(self):
        res = self.check([ready_line()] + tick_lines(7), need_after=5, after_index=4)
        self.assertProblem(res, "only 3 ticks after index 4, need 5")
        res = self.check([ready_line()] + tick_lines(9), need_after=5, after_index=4)
        self.assertTrue(res["pass"], res["problems"])

    def test_garbage_tick_line_fails(self):
        lines = tick_lines(4)
        lines.insert(2, "tick 2 counter three state 0x1 sum 0x2 ok 1 err 0 us 5 dt_us 5")
        res = self.check([ready_line()] + lines)
        self.assertProblem(res, "1 error lines, first: unparsable: tick 2 counter three")

    def test_tick_line_with_a_missing_field_fails(self):
        lines = tick_lines(3) + ["tick 3 counter 4 ok 1"]
        res = self.check([ready_line()] + lines)
        self.assertProblem(res, "unparsable: tick 3 counter 4 ok 1")

    def test_other_lines_and_a_line_still_being_written_are_ignored(self):
        lines = ["start pid 4242 gib 1", "", "gpusnap-agent: hello", ready_line()] + tick_lines(5)
        res = self.check(lines, tail="tick 5 counter 6 sta")
        self.assertTrue(res["pass"], res["problems"])
        self.assertEqual(res["n_ticks"], 5)

    def test_pause_is_the_gap_around_the_dump(self):
        lines = tick_lines(5) + tick_lines(5, first=5)
        # move ticks 5.. 2 s later: the dump stopped the process between tick 4 and tick 5
        lines[5:] = [with_word(line, "us", int(word(line, "us")) + 2_000_000) for line in lines[5:]]
        t_dump = (1_700_000_000_000_000 + 4 * 100000) / 1e6 + 0.05
        res = self.check([ready_line()] + lines, window=(t_dump, t_dump + 1))
        self.assertTrue(res["pass"], res["problems"])
        self.assertEqual(res["gap_ticks"], [4, 5])
        self.assertEqual(res["gap_s"], 2.1)
        self.assertEqual(res["pause_s"], 2.0)

    def test_mock_workload_log_passes(self):
        # gpu/mock_workload.py stands in for the C workload in --mock runs: the checker must
        # accept what it writes
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "mock_workload.py"), "--gib", "0.1",
                              "--interval-ms", "10", "--log", self.path],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 30
            while len(parse_workload_log(self.path)[1]) < 5 and time.time() < deadline:
                self.assertIsNone(p.poll(), "mock_workload.py exited")
                time.sleep(0.02)
        finally:
            p.kill()
            p.wait()
        res = check_ticks(*parse_workload_log(self.path), need_after=5)
        self.assertTrue(res["pass"], res["problems"])


if __name__ == "__main__":
    unittest.main()
