"""The Mooncake Store tier: block objects in a store that many engines share.

``tier`` (:class:`~kvtier.tiering_spec.tiers.store.tier.StoreTier`: the tier the manager
calls, and the store client it drives).

Nothing is imported here, so importing one module of the folder loads no other.
"""
