"""Plain-JAX reference implementations of every op in the model.

These are the semantics: the model calls them on the "xla" kernel path, and every Pallas kernel in
lingjax/pallas/ is tested against them. The math they implement: docs/model.md.
"""
