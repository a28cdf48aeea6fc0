"""Tests written for surviving mutants of guard/ (bench/mutation.py)."""
