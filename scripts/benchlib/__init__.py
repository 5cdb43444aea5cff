"""Benchmark and fault-injection tooling used only by scripts/ and tests/, never shipped in the package.

The scripts run as ``python scripts/x.py`` (scripts/ is then on sys.path: ``from benchlib.floor import ...``);
the tests import it as ``scripts.benchlib`` from the repository root. Its modules import each other
relatively, so both names work.
"""
