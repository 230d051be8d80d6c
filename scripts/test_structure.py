"""Unit tests of scripts/structure.py on small workspaces written to a temporary directory.

    python3 -B -m unittest discover -v -s scripts -p 'test_*.py'
"""

import contextlib
import io
import os
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import structure  # noqa: E402

LAYERS = """
[tests]
crates = ["criu-tests"]
prefixes = ["fake-"]

[layers]
"gpusnap-a" = []
"gpusnap-b" = ["gpusnap-a"]
"""


class Tree:
    """A workspace in a temporary directory: write(path, text), then check()."""

    def __init__(self, test, members=("a", "b"), layers=LAYERS):
        self.tmp = tempfile.TemporaryDirectory()
        test.addCleanup(self.tmp.cleanup)
        self.root = self.tmp.name
        self.write("Cargo.toml", f"""
            [workspace]
            members = [{", ".join(f'"{m}"' for m in members)}]

            [workspace.dependencies]
            gpusnap-a = {{ path = "a" }}
            gpusnap-b = {{ path = "b" }}
            """)
        self.write("scripts/layers.toml", layers)
        for m in members:
            self.package(m, f"gpusnap-{m}")
            self.write(f"{m}/src/lib.rs", "//! Nothing yet.\n")

    def write(self, path, text):
        full = os.path.join(self.root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(textwrap.dedent(text).lstrip("\n"))

    def package(self, directory, name, deps="", dev_deps=""):
        self.write(f"{directory}/Cargo.toml", f"""
            [package]
            name = "{name}"
            version = "0.1.0"

            [dependencies]
            {deps}

            [dev-dependencies]
            {dev_deps}
            """)

    def check(self):
        lines, fails = structure.check(self.root, os.path.join(self.root, "scripts/layers.toml"))
        return "\n".join(lines), fails


class Cycles(unittest.TestCase):
    def test_a_cycle_between_two_modules_names_both_uses(self):
        t = Tree(self)
        t.write("a/src/lib.rs", """
            //! Modules: `x`, `y`.
            mod x;
            mod y;
            """)
        t.write("a/src/x.rs", """
            use std::fmt;

            pub fn f() -> u32 {
                crate::y::g()
            }
            """)
        t.write("a/src/y.rs", "use crate::x::f;\npub fn g() -> u32 { 1 }\n")
        out, fails = t.check()
        self.assertEqual(fails, 1, out)
        self.assertIn("FAIL cycle: gpusnap-a: x <-> y", out)
        self.assertIn("x -> y: a/src/x.rs:4", out)
        self.assertIn("y -> x: a/src/y.rs:1", out)

    def test_no_cycle_one_way(self):
        t = Tree(self)
        t.write("a/src/lib.rs", "//! `x`, `y`\nmod x;\nmod y;\n")
        t.write("a/src/x.rs", "use crate::y::g;\n")
        t.write("a/src/y.rs", "pub fn g() {}\n")
        out, fails = t.check()
        self.assertEqual(fails, 0, out)
        self.assertNotIn("cycle", out)

    def test_grouped_multiline_use_tree(self):
        t = Tree(self)
        t.write("a/src/lib.rs", "//! `x`, `y`, `z`\nmod x;\nmod y;\nmod z;\n")
        t.write("a/src/x.rs", """
            use crate::{
                y::{self, Y},
                z::{
                    deep::{A as B, C},
                },
            };
            """)
        t.write("a/src/y.rs", "pub struct Y;\n")
        t.write("a/src/z.rs", """
            pub mod deep {
                pub struct A;
                pub fn f() { crate::x::h() }
            }
            """)
        out, fails = t.check()
        self.assertEqual(fails, 1, out)
        # z's inline module `deep` uses x; x uses z::deep: a cycle between x and z, not y.
        self.assertIn("FAIL cycle: gpusnap-a: x <-> z", out)
        self.assertIn("x -> z: a/src/x.rs:1", out)
        self.assertIn("z -> x: a/src/z.rs:3", out)

    def test_super_between_siblings_of_a_nested_module(self):
        t = Tree(self)
        t.write("a/src/lib.rs", "//! `amd`, `other`\npub mod amd;\nmod other;\n")
        t.write("a/src/amd/mod.rs", "mod dump;\nmod phase;\npub struct Side;\n")
        # dump uses its parent (normal) and its sibling; phase uses its sibling through
        # super::super::amd (a long way round).
        t.write("a/src/amd/dump.rs", "use super::Side;\nuse super::phase::P;\n")
        t.write("a/src/amd/phase.rs", "pub struct P;\nfn f() { super::super::amd::dump::g(); }\n")
        t.write("a/src/other.rs", "use crate::amd::Side;\n")
        out, fails = t.check()
        self.assertEqual(fails, 1, out)
        self.assertIn("FAIL cycle: gpusnap-a (children of `amd`): amd::dump <-> amd::phase", out)
        self.assertIn("amd::dump -> amd::phase: a/src/amd/dump.rs:2", out)
        self.assertIn("amd::phase -> amd::dump: a/src/amd/phase.rs:2", out)
        self.assertNotIn("amd <-> other", out)

    def test_a_use_of_an_ancestor_or_descendant_is_no_cycle(self):
        t = Tree(self)
        t.write("a/src/lib.rs", "//! `p`\nmod p;\npub fn top() {}\n")
        t.write("a/src/p.rs", "mod c;\nuse c::thing;\npub fn up() { crate::top() }\n")
        t.write("a/src/p/c.rs", "pub fn thing() { super::up(); crate::p::up(); }\n")
        out, fails = t.check()
        self.assertEqual(fails, 0, out)

    def test_what_is_not_code_is_not_a_use(self):
        t = Tree(self)
        t.write("a/src/lib.rs", "//! `x`, `y`\n#[macro_use]\nmod x;\nmod y;\n")
        t.write("a/src/x.rs", """
            /// See [`crate::y::g`].
            // crate::y::g
            /* crate::y::g /* nested */ */
            pub const S: &str = "crate::y::g";
            pub const R: &str = r#"crate::y::g "quoted" "#;
            pub const C: char = '{';
            pub fn life<'a>(s: &'a str) -> &'a str { s }
            macro_rules! m { () => { $crate::y::g() }; }
            #[cfg(test)]
            fn helper() { crate::y::g(); }
            #[cfg(test)]
            use crate::y::g;
            #[cfg(test)]
            mod tests {
                use crate::y::*;
            }
            """)
        t.write("a/src/y.rs", "pub fn g() { crate::x::life(\"\"); }\n")
        out, fails = t.check()
        self.assertEqual(fails, 0, out)

    def test_test_modules_are_not_read(self):
        t = Tree(self)
        # The files of `tests` and of a #[cfg(test)] module need not even exist.
        t.write("a/src/lib.rs", "//! `x`\nmod x;\n#[cfg(test)]\nmod helpers;\nmod tests;\n")
        t.write("a/src/x.rs", "pub fn f() {}\n")
        out, fails = t.check()
        self.assertEqual(fails, 0, out)

    def test_path_attribute_and_a_missing_file(self):
        t = Tree(self)
        t.write("a/src/lib.rs", """
            //! `x`, `y`, `gone`
            #[path = "elsewhere/xx.rs"]
            mod x;
            mod y;
            mod gone;
            """)
        t.write("a/src/elsewhere/xx.rs", "use crate::y::Y;\n")
        t.write("a/src/y.rs", "pub struct Y;\nfn f() { crate::x::g() }\n")
        out, fails = t.check()
        self.assertIn("FAIL cycle: gpusnap-a: x <-> y", out)
        self.assertIn("x -> y: a/src/elsewhere/xx.rs:1", out)
        self.assertIn("module `gone`", out)
        self.assertEqual(fails, 2, out)

    def test_a_main_rs_crate(self):
        t = Tree(self)
        os.remove(os.path.join(t.root, "b/src/lib.rs"))
        t.write("b/src/main.rs", "//! `p`, `q`\nmod p;\nmod q;\nfn main() {}\n")
        t.write("b/src/p.rs", "use crate::q;\n")
        t.write("b/src/q.rs", "use crate::p;\n")
        out, fails = t.check()
        self.assertIn("FAIL cycle: gpusnap-b: p <-> q", out)
        self.assertEqual(fails, 1, out)


class Layers(unittest.TestCase):
    def test_a_dependency_the_table_does_not_allow(self):
        t = Tree(self)
        t.package("a", "gpusnap-a", deps="gpusnap-b.workspace = true")
        out, fails = t.check()
        self.assertEqual(fails, 1, out)
        self.assertIn("FAIL layers: gpusnap-a depends on gpusnap-b", out)

    def test_allowed_path_and_dev_dependencies(self):
        t = Tree(self)
        t.package("b", "gpusnap-b", deps='gpusnap-a = { path = "../a" }')
        t.package("a", "gpusnap-a", dev_deps="gpusnap-b.workspace = true")
        out, fails = t.check()
        self.assertEqual(fails, 0, out)

    def test_a_path_dependency_is_found_by_its_directory(self):
        t = Tree(self)
        t.package("a", "gpusnap-a", deps='renamed = { path = "../b" }')
        out, fails = t.check()
        self.assertIn("FAIL layers: gpusnap-a depends on gpusnap-b", out)
        self.assertEqual(fails, 1, out)

    def test_a_crate_missing_from_the_table_fails_a_test_crate_does_not(self):
        t = Tree(self, members=("a", "b", "c", "fake-x", "criu-tests"))
        t.package("fake-x", "fake-x", deps="gpusnap-b.workspace = true")
        t.package("criu-tests", "criu-tests", deps="gpusnap-b.workspace = true")
        out, fails = t.check()
        self.assertIn("FAIL layers: gpusnap-c (c) is not in", out)
        self.assertNotIn("fake-x", out)
        self.assertNotIn("criu-tests", out)
        self.assertEqual(fails, 1, out)

    def test_a_crate_in_the_table_not_in_the_workspace_is_a_note(self):
        t = Tree(self, layers=LAYERS + '"gpusnap-host" = ["gpusnap-a"]\n')
        out, fails = t.check()
        self.assertEqual(fails, 0, out)
        self.assertIn("NOTE layers: gpusnap-host is in [layers] but not in the workspace", out)

    def test_the_root_package_is_a_crate(self):
        t = Tree(self)
        t.write("Cargo.toml", """
            [workspace]
            members = ["a", "b"]

            [workspace.dependencies]
            gpusnap-a = { path = "a" }
            gpusnap-b = { path = "b" }

            [package]
            name = "gpusnap"
            version = "0.1.0"

            [dependencies]
            gpusnap-b.workspace = true
            """)
        t.write("src/main.rs", "//! `m`\nmod m;\n")
        t.write("src/m.rs", "\n")
        out, fails = t.check()
        self.assertIn("FAIL layers: gpusnap (.) is not in", out)
        self.assertEqual(fails, 1, out)


class ModuleMaps(unittest.TestCase):
    def test_a_module_missing_from_the_map(self):
        t = Tree(self)
        t.write("a/src/lib.rs", """
            //! The crate. Modules:
            //! - [`x`]: the first;
            //! - `y::Thing` lives in y.
            pub mod x;
            pub(crate) mod y;
            mod z;
            #[cfg(test)]
            mod test_helpers;
            """)
        for m in "xyz":
            t.write(f"a/src/{m}.rs", "\n")
        out, fails = t.check()
        self.assertEqual(fails, 1, out)
        self.assertIn("FAIL module map: gpusnap-a: `z` is declared in a/src/lib.rs", out)
        self.assertNotIn("test_helpers", out)

    def test_the_map_is_the_leading_comment_only(self):
        t = Tree(self)
        t.write("a/src/lib.rs", "//! Nothing.\nmod x;\n/// `x`\npub fn f() {}\n")
        t.write("a/src/x.rs", "\n")
        out, fails = t.check()
        self.assertIn("`x` is declared", out)
        self.assertEqual(fails, 1, out)


class Known(unittest.TestCase):
    def cyclic_tree(self, known):
        t = Tree(self, layers=LAYERS + known)
        t.write("a/src/lib.rs", "//! `x`\nmod x;\nmod y;\n")
        t.write("a/src/x.rs", "use crate::y::g;\n")
        t.write("a/src/y.rs", "use crate::x;\n")
        return t

    def test_known_problems_are_printed_not_failed(self):
        t = self.cyclic_tree("""
            [[known]]
            kind = "cycle"
            crate = "gpusnap-a"
            modules = ["y", "x"]
            reason = "being untangled"

            [[known]]
            kind = "module-map"
            crate = "gpusnap-a"
            modules = ["y"]
            reason = "a later map"
            """)
        out, fails = t.check()
        self.assertEqual(fails, 0, out)
        self.assertIn("KNOWN cycle: gpusnap-a: x <-> y (being untangled)", out)
        self.assertIn("KNOWN module map: gpusnap-a: `y`", out)

    def test_a_known_entry_that_no_longer_occurs_fails(self):
        t = self.cyclic_tree("""
            [[known]]
            kind = "cycle"
            crate = "gpusnap-a"
            modules = ["x", "y"]
            reason = "being untangled"

            [[known]]
            kind = "dependency"
            crate = "gpusnap-b"
            on = "gpusnap-x"
            reason = "gone"

            [[known]]
            kind = "module-map"
            crate = "gpusnap-a"
            modules = ["y", "x"]
            reason = "a later map"
            """)
        t.write("a/src/y.rs", "pub fn g() {}\n")
        out, fails = t.check()
        self.assertIn("FAIL known entry no longer occurs (remove it from scripts/layers.toml): "
                      "cycle gpusnap-a: x <-> y", out)
        self.assertIn("dependency gpusnap-b: gpusnap-x", out)
        self.assertIn("module-map gpusnap-a: x", out)
        self.assertEqual(fails, 3, out)

    def test_a_bigger_cycle_than_the_known_one_fails(self):
        t = self.cyclic_tree("""
            [[known]]
            kind = "cycle"
            crate = "gpusnap-a"
            modules = ["x", "y"]
            reason = "being untangled"
            """)
        t.write("a/src/lib.rs", "//! `x` `y` `z`\nmod x;\nmod y;\nmod z;\n")
        t.write("a/src/y.rs", "use crate::z;\n")
        t.write("a/src/z.rs", "use crate::x;\n")
        out, fails = t.check()
        self.assertIn("FAIL cycle: gpusnap-a: x <-> y <-> z", out)
        self.assertIn("FAIL known entry no longer occurs", out)
        self.assertEqual(fails, 2, out)

    def test_a_known_entry_without_a_reason_is_a_configuration_error(self):
        t = self.cyclic_tree("""
            [[known]]
            kind = "cycle"
            crate = "gpusnap-a"
            modules = ["x", "y"]
            """)
        with self.assertRaises(structure.ConfigError):
            t.check()


class Main(unittest.TestCase):
    def main(self, root):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = structure.main(["--root", root])
        return rc, out.getvalue()

    def test_exit_status(self):
        t = Tree(self)
        rc, out = self.main(t.root)
        self.assertEqual(rc, 0, out)
        self.assertIn("structure.py: ok (0 known problem(s), listed in scripts/layers.toml)", out)
        t.package("a", "gpusnap-a", deps="gpusnap-b.workspace = true")
        rc, out = self.main(t.root)
        self.assertEqual(rc, 1, out)
        self.assertIn("structure.py: FAILED: 1 problem(s); 0 known", out)
        t.write("scripts/layers.toml", "[layers\n")
        rc, out = self.main(t.root)
        self.assertEqual(rc, 2, out)
        self.assertIn("scripts/layers.toml", out)


if __name__ == "__main__":
    unittest.main()
