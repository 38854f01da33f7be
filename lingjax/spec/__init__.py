"""Speculative decoding: drafters (drafters.py: the NEXTN chain with the MTP layer, and a replay of a known
continuation for tests and benchmarks; dspark.py: DSpark's block drafter, its network in dspark_model.py),
acceptance rules (accept.py), and the speculative round as one jitted program (step.py). The host loop is
lingjax.engine.generate(..., spec="nextn" | "dspark").
"""
