"""Benchmarks (not tests): each module measures riverbed against a baseline in the same run."""
