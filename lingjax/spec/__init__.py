"""Speculative decoding: drafters (drafters.py: the NEXTN chain with the MTP layer; DSpark block
drafting plugs into the same interface), acceptance rules (accept.py), and the speculative round as
one jitted program (step.py). The host loop is lingjax.engine.generate(..., spec="nextn").
"""
