"""Copies an evaluation store (SQLite) into one file, its write-ahead log folded in: a plain
copy of dice.db leaves behind the log, where a cut run's latest results are.

    python3 bench/store_copy.py SOURCE.db DEST.db
"""

import sqlite3
import sys

source, dest = sys.argv[1:3]
sqlite3.connect(source).backup(sqlite3.connect(dest))
