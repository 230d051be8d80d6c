#!/usr/bin/env python3
"""The plan checked against the code: gpusnap's structure rules (issue 34).

    python3 scripts/structure.py [--root DIR] [--layers FILE]

Checks, for every shipped crate of the workspace (the members that are not test crates; the
rules in scripts/layers.toml say which those are):

1. No import cycle between modules. Each crate's module tree is built from its `mod`
   declarations, from src/lib.rs and src/main.rs down (`x.rs`, `x/mod.rs`, `#[path]`; no
   `#[cfg(test)]` module, no `mod tests`). Module A uses module B where A's code (comments,
   strings, `#[cfg(test)]` items and `$crate` macro text left out) names `crate::B...`,
   `super::...` or `self::...` resolving to B, plain or in a `use` tree. A use of one's own
   ancestor or descendant is no tie between siblings; so, for every module that has children
   (the crate root included), the uses between its children's subtrees are collapsed to uses
   between those children, and a set of children that reach each other is a cycle.
2. Layers: each shipped crate depends (its [dependencies], including target-specific ones, and
   [build-dependencies]; never [dev-dependencies]) only on the workspace crates that
   scripts/layers.toml allows it; a shipped crate missing from the table is a problem.
3. Module maps: every module declared in a crate's lib.rs or main.rs is named, as `name` in
   backticks, in that file's leading `//!` comment.

A problem listed in layers.toml's [[known]] entries (with its reason) is printed as KNOWN, not
failed; a known entry that no longer occurs fails the run, so the list only shrinks. Exit status:
0 when nothing but KNOWN problems was found, 1 otherwise, 2 on a usage or configuration error.
Python 3.11 standard library only.
"""

import argparse
import bisect
import glob
import os
import re
import sys
import tomllib

# ---------------------------------------------------------------------------------------------
# Rust source: tokens, with comments, strings, character literals and lifetimes left out.

_TOKEN = re.compile(
    r"""
    (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<raw>b?r(?P<hashes>\#*)"(?P<rawbody>.*?)"(?P=hashes))
  | (?P<str>b?"(?P<strbody>(?:[^"\\]|\\.)*)")
  | (?P<char>b?'(?:[^'\\\n]|\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}|.))')
  | (?P<lifetime>'[A-Za-z_]\w*)
  | (?P<ident>(?:r\#)?[A-Za-z_]\w*)
  | (?P<num>\d\w*)
  | (?P<path>::)
  | (?P<punct>\S)
    """,
    re.S | re.X,
)

STR = "\0str"  # the token of a string literal (its text is kept in Source.strings)
_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = {v: k for k, v in _OPEN.items()}


class Source:
    """One .rs file as tokens (text, offset), its brackets matched, its test-only items marked."""

    def __init__(self, path, text):
        self.path = path
        self.toks = []
        self.offs = []
        self.strings = {}  # token index -> the string's text
        for m in _TOKEN.finditer(text):
            kind = m.lastgroup
            if kind in ("comment", "char", "lifetime"):
                continue
            if kind in ("raw", "str"):
                self.strings[len(self.toks)] = m.group("rawbody" if kind == "raw" else "strbody")
                self.toks.append(STR)
            elif kind == "ident":
                self.toks.append(m.group().removeprefix("r#"))
            else:
                self.toks.append(m.group())
            self.offs.append(m.start())
        self._newlines = [m.start() for m in re.finditer("\n", text)]
        self.match = self._match_brackets()
        self.test_only = [False] * len(self.toks)
        self.whole_file_test = False
        self._mark_test_items()

    def line(self, i):
        return bisect.bisect_left(self._newlines, self.offs[i]) + 1

    def _match_brackets(self):
        match = [None] * len(self.toks)
        stack = []
        for i, t in enumerate(self.toks):
            if t in _OPEN:
                stack.append(i)
            elif t in _CLOSE:
                # A stray closer (macro text) is ignored; an unclosed opener stays unmatched.
                while stack and self.toks[stack[-1]] != _CLOSE[t]:
                    stack.pop()
                if stack:
                    j = stack.pop()
                    match[i], match[j] = j, i
        return match

    def attr_end(self, i):
        """If an attribute `#[...]` or `#![...]` starts at token i: the index of its `]`."""
        t = self.toks
        j = i + 1
        if j < len(t) and t[j] == "!":
            j += 1
        if t[i] == "#" and j < len(t) and t[j] == "[" and self.match[j] is not None:
            return self.match[j]
        return None

    def is_cfg_test(self, i, end):
        """Whether the attribute at tokens i..end is exactly #[cfg(test)] (or #![cfg(test)])."""
        body = [x for x in self.toks[i:end + 1] if x not in ("#", "!")]
        return body == ["[", "cfg", "(", "test", ")", "]"]

    def item_end(self, i):
        """The last token of the item or statement starting at token i (after its attributes)."""
        t = self.toks
        n = len(t)
        while i < n:
            e = self.attr_end(i)
            if e is None:
                break
            i = e + 1
        while i < n:
            if t[i] == ";":
                return i
            if t[i] == "{" and self.match[i] is not None:
                return self.match[i]
            if t[i] in _OPEN and self.match[i] is not None:
                i = self.match[i] + 1
                continue
            if t[i] in _CLOSE:  # the end of the enclosing block: the item had no end of its own
                return i - 1
            i += 1
        return n - 1

    def _mark_test_items(self):
        i = 0
        n = len(self.toks)
        while i < n:
            e = self.attr_end(i) if self.toks[i] == "#" else None
            if e is not None and self.is_cfg_test(i, e):
                if self.toks[i + 1] == "!":
                    if not any(self.toks[:i].count(x) for x in "{(["):
                        self.whole_file_test = True
                    i = e + 1
                    continue
                end = self.item_end(e + 1)
                for k in range(i, end + 1):
                    self.test_only[k] = True
                i = end + 1
                continue
            i += 1


def read_source(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return Source(path, f.read())


# ---------------------------------------------------------------------------------------------
# Module trees.


class Module:
    def __init__(self, name, parent, src, lo, hi, file_dir, decl=None):
        self.name = name
        self.parent = parent
        self.src = src  # the Source holding its body
        self.lo, self.hi = lo, hi  # its body: tokens lo..hi-1 of src
        self.file_dir = file_dir  # where the files of its `mod x;` children are
        self.decl = decl  # (file, line) of its `mod` declaration
        self.children = {}
        self.path = [] if parent is None else parent.path + [name]

    def label(self):
        return "::".join(self.path) or "crate"

    def walk(self):
        yield self
        for c in self.children.values():
            yield from c.walk()


class Crate:
    def __init__(self, label, root_file, problems):
        self.label = label
        self.root_file = root_file
        self.problems = problems  # modules without a file: (file, line, name, files tried)
        src = read_source(root_file)
        self.root = Module(None, None, src, 0, len(src.toks), os.path.dirname(root_file))
        self.top_decls = []  # (name, token index) of the root file's non-test `mod`s
        self._load(self.root)

    def _load(self, module):
        src = module.src
        for name, at, attrs, body in _mod_decls(src, module.lo, module.hi):
            if module is self.root:
                self.top_decls.append((name, at))
            decl = (src.path, src.line(at))
            path_attr = _path_attr(src, attrs)
            if body is not None:  # mod x { ... }
                child = Module(name, module, src, body[0], body[1],
                               os.path.join(module.file_dir, name), decl)
                module.children[name] = child
                self._load(child)
                continue
            if path_attr is not None:
                # Relative to the file's directory; inside an inline module, to its directory.
                base = os.path.dirname(src.path) if module.lo == 0 else module.file_dir
                candidates = [os.path.join(base, path_attr)]
            else:
                candidates = [os.path.join(module.file_dir, name + ".rs"),
                              os.path.join(module.file_dir, name, "mod.rs")]
            found = next((c for c in candidates if os.path.isfile(c)), None)
            if found is None:
                self.problems.append((decl[0], decl[1], name, candidates))
                continue
            child_src = read_source(found)
            if child_src.whole_file_test:
                continue
            # A mod.rs file, or one named by #[path], keeps its children beside it.
            is_mod_rs = path_attr is not None or os.path.basename(found) == "mod.rs"
            child_dir = (os.path.dirname(found) if is_mod_rs
                         else os.path.join(os.path.dirname(found), name))
            child = Module(name, module, child_src, 0, len(child_src.toks), child_dir, decl)
            module.children[name] = child
            self._load(child)


def _mod_decls(src, lo, hi):
    """The `mod` declarations at the top level of tokens lo..hi-1: (name, index of `mod`,
    attribute token ranges, body token range or None)."""
    t = src.toks
    i = lo
    attrs = []
    out = []
    while i < hi:
        e = src.attr_end(i) if t[i] == "#" else None
        if e is not None:
            if t[i + 1] != "!":
                attrs.append((i, e))
            i = e + 1
            continue
        if t[i] == "pub":
            i += 1
            if i < hi and t[i] == "(" and src.match[i] is not None:
                i = src.match[i] + 1
            continue
        if t[i] == "mod" and i + 2 < hi and t[i + 2] in (";", "{") and re.match(r"\w+$", t[i + 1]):
            name = t[i + 1]
            body = None
            end = i + 2
            if t[i + 2] == "{" and src.match[i + 2] is not None:
                body = (i + 3, src.match[i + 2])
                end = src.match[i + 2]
            if not src.test_only[i] and name != "tests":
                out.append((name, i, attrs, body))
            attrs = []
            i = end + 1
            continue
        attrs = []
        if t[i] in _OPEN and src.match[i] is not None:
            i = src.match[i] + 1
        else:
            i += 1
    return out


def _path_attr(src, attrs):
    for a, b in attrs:
        toks = src.toks[a:b + 1]
        if toks[:4] == ["#", "[", "path", "="] and toks[4:5] == [STR]:
            return src.strings[a + 4]
    return None


# ---------------------------------------------------------------------------------------------
# Uses between modules.


def _paths_at(src, i):
    """The module paths a path starting at token i (`crate`, `super` or `self`) names: a list of
    segment lists (one per leaf of a `use` tree)."""
    t = src.toks
    n = len(t)

    def tree(j, prefix):
        """Parse a use tree from token j under prefix; return (leaf paths, next index)."""
        segs = list(prefix)
        leaves = []
        while j < n:
            if t[j] == "{":
                end = src.match[j]
                if end is None:
                    return leaves + [segs], n
                k = j + 1
                while k < end:
                    sub, k = tree(k, segs)
                    leaves.extend(sub)
                    while k < end and t[k] != ",":
                        k += 1  # `as name`, or anything unexpected
                    k += 1
                return leaves, end + 1
            if t[j] == "*":
                return leaves + [segs], j + 1
            if re.match(r"\w+$", t[j]) and t[j] != STR:
                if t[j] == "self" and segs:
                    pass  # `a::{self, b}`: `self` is the prefix itself
                else:
                    segs.append(t[j])
                j += 1
                if j < n and t[j] == "::":
                    j += 1
                    continue
                return leaves + [segs], j
            return leaves + [segs], j
        return leaves + [segs], j

    leaves, _ = tree(i, [])
    return leaves


def _resolve(module, segs):
    """The deepest module that the segments (starting with crate/super/self) reach."""
    first = segs[0]
    if first == "crate":
        node = module
        while node.parent is not None:
            node = node.parent
    elif first == "super":
        node = module.parent or module
    else:  # self
        node = module
    for s in segs[1:]:
        if s == "super":
            node = node.parent or node
        elif s == "self":
            continue
        elif s in node.children:
            node = node.children[s]
        else:
            break
    return node


_PATH_STARTS = frozenset(("crate", "super", "self"))


def uses(crate):
    """Every use of one module by another: (user, used, file, line), in source order."""
    out = []
    for m in crate.root.walk():
        src = m.src
        t = src.toks
        inner = sorted((c.lo, c.hi) for c in m.children.values() if c.src is src)
        i = m.lo
        while i < m.hi:
            if inner and i >= inner[0][0]:  # an inline child's body: its own
                i = max(i, inner.pop(0)[1])
                continue
            if (t[i] in _PATH_STARTS and i + 1 < len(t) and t[i + 1] == "::"
                    and not src.test_only[i]
                    and (i == 0 or t[i - 1] not in ("$", "::"))):
                for segs in _paths_at(src, i):
                    target = _resolve(m, segs)
                    if target is not m:
                        out.append((m, target, src.path, src.line(i)))
            i += 1
    return out


def _sccs(nodes, edges):
    """Strongly connected components (of two or more nodes) of a graph; Tarjan's algorithm."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def cycles(crate, rel):
    """For every module with two or more children: the sets of its children that use each other
    (through their subtrees). Each: (parent label, [child labels], [(a, b, "file:line"), ...])."""
    all_uses = uses(crate)
    found = []
    for parent in crate.root.walk():
        if len(parent.children) < 2:
            continue

        def child_of(m):
            while m is not None and m.parent is not parent:
                m = m.parent
            return m

        edges, where = {}, {}
        for a, b, path, line in all_uses:
            ca, cb = child_of(a), child_of(b)
            if ca is None or cb is None or ca is cb:
                continue
            edges.setdefault(ca.label(), set()).add(cb.label())
            where.setdefault((ca.label(), cb.label()), f"{rel(path)}:{line}")
        for comp in _sccs([c.label() for c in parent.children.values()], edges):
            inside = [(a, b, where[(a, b)]) for a in comp for b in sorted(edges.get(a, ()))
                      if b in comp]
            found.append((parent.label(), comp, inside))
    return found


# ---------------------------------------------------------------------------------------------
# Module maps.


def module_map_missing(crate):
    """The root file's declared modules that its leading `//!` comment does not name."""
    with open(crate.root_file, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    doc = []
    for line in lines:
        s = line.strip()
        if s.startswith("//!"):
            doc.append(s[3:])
        elif s and not s.startswith("#!["):
            break
    named = set()
    for span in re.findall(r"`([^`]*)`", "\n".join(doc)):
        m = re.match(r"(\w+)(?:::|$)", span.strip())
        if m:
            named.add(m.group(1))
    seen = []
    for name, _ in crate.top_decls:
        if name not in named and name not in seen:
            seen.append(name)
    return seen


# ---------------------------------------------------------------------------------------------
# The workspace.


class ConfigError(Exception):
    pass


def _load_toml(path):
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from e


def workspace(root):
    """The workspace's packages: {package name: (directory, its Cargo.toml as a dict)}, and the
    root's [workspace.dependencies]."""
    top = _load_toml(os.path.join(root, "Cargo.toml"))
    ws = top.get("workspace", {})
    excluded = {os.path.normpath(os.path.join(root, e)) for e in ws.get("exclude", [])}
    dirs = []
    if "package" in top:
        dirs.append(root)
    for member in ws.get("members", []):
        for d in sorted(glob.glob(os.path.join(root, member))):
            d = os.path.normpath(d)
            if (d not in excluded and d not in dirs
                    and os.path.isfile(os.path.join(d, "Cargo.toml"))):
                dirs.append(d)
    packages = {}
    for d in dirs:
        manifest = top if d == root else _load_toml(os.path.join(d, "Cargo.toml"))
        name = manifest.get("package", {}).get("name")
        if name:
            packages[name] = (d, manifest)
    return packages, ws.get("dependencies", {})


def crate_roots(pkg_dir, manifest):
    """The crate root files of a package's lib and bins: [(label suffix, path)]."""
    roots = []
    lib = manifest.get("lib", {}).get("path")
    lib = os.path.join(pkg_dir, lib) if lib else os.path.join(pkg_dir, "src", "lib.rs")
    if os.path.isfile(lib):
        roots.append(("lib", lib))
    bins = [os.path.join(pkg_dir, b["path"]) for b in manifest.get("bin", []) if "path" in b]
    main = os.path.join(pkg_dir, "src", "main.rs")
    if not bins and os.path.isfile(main):
        bins.append(main)
    bins += sorted(glob.glob(os.path.join(pkg_dir, "src", "bin", "*.rs")) +
                   glob.glob(os.path.join(pkg_dir, "src", "bin", "*", "main.rs")))
    for b in dict.fromkeys(bins):
        if os.path.isfile(b):
            roots.append((f"bin {os.path.relpath(b, pkg_dir)}", b))
    return roots


def workspace_deps(root, pkg_dir, manifest, packages, ws_deps):
    """The workspace packages a package depends on outside its dev-dependencies (`workspace =
    true` entries through the root's [workspace.dependencies], `path` entries, or by name)."""
    by_dir = {os.path.normpath(d): name for name, (d, _) in packages.items()}
    tables = [manifest.get("dependencies", {}), manifest.get("build-dependencies", {})]
    for target in manifest.get("target", {}).values():
        tables += [target.get("dependencies", {}), target.get("build-dependencies", {})]
    found = set()
    for table in tables:
        for key, spec in table.items():
            spec = spec if isinstance(spec, dict) else {"version": spec}
            base = pkg_dir
            real = spec.get("package", key)
            if spec.get("workspace"):
                wspec = ws_deps.get(key, {})
                wspec = wspec if isinstance(wspec, dict) else {}
                real = wspec.get("package", real)
                spec = wspec
                base = root
            if "path" in spec:
                name = by_dir.get(os.path.normpath(os.path.join(base, spec["path"])))
                if name:
                    found.add(name)
                    continue
            if real in packages:
                found.add(real)
    return found


# ---------------------------------------------------------------------------------------------
# The check.


def check(root, layers_path):
    """Run every check; return (printed lines, number of failures)."""
    rules = _load_toml(layers_path)
    layers = rules.get("layers")
    if not isinstance(layers, dict):
        raise ConfigError(f"{layers_path}: no [layers] table")
    tests = rules.get("tests", {})
    test_names = set(tests.get("crates", []))
    test_prefixes = tuple(tests.get("prefixes", []))
    known = rules.get("known", [])
    for k in known:
        if (k.get("kind") not in ("cycle", "dependency", "module-map") or not k.get("reason")
                or not isinstance(k.get("crate"), str) or not _known_keys(k)):
            raise ConfigError(f"{layers_path}: a [[known]] entry needs a kind (cycle, dependency "
                              f"or module-map), a crate, a reason and what it lists (modules, on "
                              f"or module): {k}")

    def rel(p):
        return os.path.relpath(p, root)

    packages, ws_deps = workspace(root)
    shipped = sorted(n for n in packages if n not in test_names and not n.startswith(test_prefixes))
    lines, fails = [], 0
    used_known = set()  # (index of the [[known]] entry, key)

    def report(kind, crate, key, text, details=()):
        nonlocal fails
        for idx, k in enumerate(known):
            if k["kind"] == kind and k["crate"] == crate and key in _known_keys(k):
                used_known.add((idx, key))
                lines.append(f"KNOWN {text} ({k['reason']})")
                break
        else:
            fails += 1
            lines.append(f"FAIL {text}")
        lines.extend(f"    {d}" for d in details)

    # 2. Layers.
    for name in shipped:
        d, manifest = packages[name]
        if name not in layers:
            fails += 1
            lines.append(f"FAIL layers: {name} ({rel(d) or '.'}) is not in {rel(layers_path)}'s "
                         f"[layers]: say which workspace crates it may use")
            continue
        allowed = set(layers[name])
        for dep in sorted(workspace_deps(root, d, manifest, packages, ws_deps) - allowed):
            report("dependency", name, dep,
                   f"layers: {name} depends on {dep}, which [layers] does not allow "
                   f"(allowed: {', '.join(sorted(allowed)) or 'none'})")
    for name in sorted(layers):
        if name not in packages:
            lines.append(f"NOTE layers: {name} is in [layers] but not in the workspace (yet)")
        elif name not in shipped:
            lines.append(f"NOTE layers: {name} is in [layers] but is a test crate")

    # 1 and 3: cycles and module maps.
    for name in shipped:
        d, manifest = packages[name]
        roots = crate_roots(d, manifest)
        for suffix, root_file in roots:
            label = name if len(roots) == 1 else f"{name} ({suffix})"
            problems = []
            crate = Crate(label, root_file, problems)
            for path, line, mod, tried in problems:
                fails += 1
                lines.append(f"FAIL {label}: {rel(path)}:{line}: module `{mod}` has no file "
                             f"(none of {', '.join(rel(x) for x in tried)})")
            for parent, comp, edges in cycles(crate, rel):
                where = "" if parent == "crate" else f" (children of `{parent}`)"
                report("cycle", label, frozenset(comp),
                       f"cycle: {label}{where}: {' <-> '.join(comp)}",
                       [f"{a} -> {b}: {at}" for a, b, at in edges])
            for missing in module_map_missing(crate):
                report("module-map", label, missing,
                       f"module map: {label}: `{missing}` is declared in {rel(root_file)} but "
                       f"not named in its leading //! comment")
    for idx, k in enumerate(known):
        for key in _known_keys(k):
            if (idx, key) not in used_known:
                fails += 1
                what = " <-> ".join(sorted(key)) if k["kind"] == "cycle" else key
                lines.append(f"FAIL known entry no longer occurs (remove it from "
                             f"{rel(layers_path)}): {k['kind']} {k['crate']}: {what}")
    return lines, fails


def _known_keys(k):
    """What a [[known]] entry lists: a cycle's set of modules; the crates a dependency entry
    names (`on`); the modules a module-map entry names (`module` or `modules`)."""
    if k.get("kind") == "cycle":
        mods = k.get("modules")
        return [frozenset(mods)] if isinstance(mods, list) and len(mods) > 1 else []
    field = "on" if k.get("kind") == "dependency" else "module"
    keys = k.get(field + "s", []) if isinstance(k.get(field + "s"), list) else []
    if isinstance(k.get(field), str):
        keys = keys + [k[field]]
    return keys


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.dirname(here), help="the workspace (default: "
                    "this script's repository)")
    ap.add_argument("--layers", help="the rules (default: ROOT/scripts/layers.toml)")
    args = ap.parse_args(argv)
    layers = args.layers or os.path.join(args.root, "scripts", "layers.toml")
    try:
        lines, fails = check(args.root, layers)
    except ConfigError as e:
        print(f"structure.py: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    known = sum(1 for line in lines if line.startswith("KNOWN"))
    if fails:
        print(f"structure.py: FAILED: {fails} problem(s); {known} known", file=sys.stderr)
        return 1
    print(f"structure.py: ok ({known} known problem(s), listed in "
          f"{os.path.relpath(layers, args.root)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
