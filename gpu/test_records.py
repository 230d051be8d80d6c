"""Fields the GPU scripts derive for their records (bench/results/*.jsonl)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crlib import criu  # noqa: E402


class DataPathTest(unittest.TestCase):
    """`data_path` of a dump's record, from the plugin's routes lines."""

    def test_lent_copied_and_mixed(self):
        lent = "(00.17) gpusnap: pid 1: routes: 16 lent, 0 copied first, 0 left to the driver; 16 lend"
        copied = "(00.17) gpusnap: pid 2: routes: 0 lent, 3 copied first, 1 left to the driver"
        both = "(00.17) gpusnap: pid 3: routes: 2 lent, 1 copied first, 0 left to the driver"
        self.assertEqual(criu.data_path([lent]), "handoff")
        self.assertEqual(criu.data_path([copied]), "copy")
        self.assertEqual(criu.data_path([both]), "mixed")
        # Two processes that went different ways make the dump mixed.
        self.assertEqual(criu.data_path([lent, copied]), "mixed")
        self.assertEqual(criu.data_path([lent, lent]), "handoff")

    def test_no_split_process_is_none(self):
        self.assertIsNone(criu.data_path(["gpusnap: transparent path for pid 4", ""]))


if __name__ == "__main__":
    unittest.main()
