"""Wire contracts: JSON Schema files for the public topics, the records they decode to, and
the versioned binary layout of the internal topics. See ``docs/wire-formats.md``."""
