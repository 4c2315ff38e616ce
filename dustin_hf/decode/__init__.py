"""The decode loop and the state it keeps: the decoder a call runs with (:mod:`.decoder`) and its settings
(:mod:`.settings`), the per-call run and its step (:mod:`.run`), exact mode's step and confirmation (:mod:`.exact_step`,
:mod:`.exact`), the acceptance rule (:mod:`.sampling`); the rows' tokens and lengths (:mod:`.rows`), the KV cache
(:mod:`.cache`), a model driven one plan at a time (:mod:`.runner`), the ragged batch read as stock reads it
(:mod:`.masks`, :mod:`.processors`, :mod:`.outputs`), what a run keeps for the next (:mod:`.workspace`), its
statistics (:mod:`.stats`) and the hooks benchmarks plug in (:mod:`.hooks`)."""
