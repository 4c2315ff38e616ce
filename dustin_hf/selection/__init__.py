"""Which cached positions a sparse step reads.

The read-set policies, one file each: the paper's fixed budget (:mod:`.dustin_set`), the quality knob
(:mod:`.knob`), both chosen before the verification forward behind one interface and picked from the config by
the registry of :mod:`.selector` (the decode loop's front); and the selection layers (:mod:`.layers`), which choose
again inside the forward. Below them, the shared machinery: what a policy is handed and the two signals it scores
with (:mod:`.request`, :mod:`.history`), the scoring on chosen heads (:mod:`.scoring`), the budget fill and the read
sets' type (:mod:`.fill`), the draft's reads (:mod:`.draft_reads`), and how much attention a set recovers
(:mod:`.recovery`)."""
