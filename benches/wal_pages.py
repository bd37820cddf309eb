#!/usr/bin/env python3
"""Which b-trees each of the last commits in a SQLite WAL wrote, page by page.

Usage: wal_pages.py STATE_DB [COMMITS] [--mean]

With `--mean`, prints instead the mean over those commits: pages per commit, and each
b-tree's pages per commit (pages `dbstat` does not list, counted together as `?`).

Reads STATE_DB's `-wal` file frame by frame (a frame's header names its page; a commit's
last frame carries the database size), and names each page's b-tree from the `dbstat`
virtual table (the `sqlite3` shell, read-only). Pages `dbstat` does not list (free-list
trunks) show as `?N`. Run it while the server runs, between two checkpoints: the WAL starts
over after each, so the last commits are there. docs/profiling.md, the twelfth pass.
"""

import collections
import struct
import subprocess
import sys


def commits(wal):
    _magic, _version, page_size, _seq, salt1, salt2, _c1, _c2 = struct.unpack(">8I", wal[:32])
    offset, pages, found = 32, [], []
    while offset + 24 + page_size <= len(wal):
        page, db_size, frame_salt1, frame_salt2 = struct.unpack(">4I", wal[offset : offset + 16])
        if (frame_salt1, frame_salt2) != (salt1, salt2):
            break  # frames of an earlier pass over the file
        pages.append(page)
        if db_size:
            found.append(pages)
            pages = []
        offset += 24 + page_size
    return page_size, found


def main():
    args = [a for a in sys.argv[1:] if a != "--mean"]
    mean = "--mean" in sys.argv[1:]
    db = args[0]
    last = int(args[1]) if len(args) > 1 else 5
    try:
        with open(db + "-wal", "rb") as f:
            page_size, found = commits(f.read())
    except FileNotFoundError:
        sys.exit(f"{db}-wal: no WAL (the server stopped, and a clean stop removes it)")
    listing = subprocess.run(
        ["sqlite3", f"file:{db}?mode=ro", "SELECT pageno, name FROM dbstat"],
        capture_output=True, text=True, check=True,
    ).stdout
    names = {int(p): n for p, n in (line.split("|", 1) for line in listing.splitlines())}
    print(f"page size {page_size}, {len(found)} commits in the WAL")
    chosen = found[-last:]
    if mean:
        if not chosen:
            sys.exit("no commit in the WAL yet")
        per_tree = collections.Counter()
        for pages in chosen:
            per_tree.update(names.get(p, "?") for p in pages)
        total = sum(len(pages) for pages in chosen)
        print(f"mean over {len(chosen)} commits: {total / len(chosen):.2f} pages, "
              f"{len(per_tree)} b-trees in all")
        for tree, count in sorted(per_tree.items()):
            print(f"  {tree}: {count / len(chosen):.2f}")
        return
    for pages in chosen:
        trees = collections.Counter(names.get(p, f"?{p}") for p in pages)
        print(f"{len(pages)} pages, {len(trees)} b-trees: {dict(sorted(trees.items()))}")


if __name__ == "__main__":
    main()
