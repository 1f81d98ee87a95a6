"""Decisions and rewrites: classify the joint graph, solve, place recompute regions."""
