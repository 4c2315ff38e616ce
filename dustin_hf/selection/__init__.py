"""Which cached positions a sparse step reads: scoring on chosen heads (:mod:`.scoring`), the budget fill
(:mod:`.fill`), the per-step selector (:mod:`.selector`), the draft's reads (:mod:`.draft_reads`), selection layers
inside the verification forward (:mod:`.layers`), and how much attention a set recovers (:mod:`.recovery`)."""
