"""The decode loop and the state it keeps: the decoder a call runs with (:mod:`.decoder`), the per-call run and its
step (:mod:`.run`), exact mode's step (:mod:`.exact_step`), the acceptance rule (:mod:`.sampling`); the KV cache
(:mod:`.cache`), a model driven one plan at a time (:mod:`.runner`), the ragged batch read as stock reads it
(:mod:`.masks`, :mod:`.processors`, :mod:`.outputs`), what a run keeps for the next (:mod:`.workspace`), its
statistics and the hooks benchmarks plug in (:mod:`.hooks`)."""
