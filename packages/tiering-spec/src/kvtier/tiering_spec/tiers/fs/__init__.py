"""The fs tier: block files in folders on a local or shared filesystem, split by concern.

``tier`` (:class:`~kvtier.tiering_spec.tiers.fs.tier.FileSystemTier`: the tier the manager
calls, its jobs and results), ``capacity`` (its budget, and which files go when it is
full), ``tasks`` (what its I/O threads do to one key's files), ``pool`` (those threads),
``index`` (entries, bytes, the eviction policy; no I/O), ``io`` (reading and writing one
block file, as functions of what they are given), ``format`` (the block file format,
which the store tier's objects share), ``dirs`` (the folders, held open) and ``scan``
(the start-up scan and the look for files other engines write).

Nothing is imported here, so importing one module of the folder loads no other.
"""
