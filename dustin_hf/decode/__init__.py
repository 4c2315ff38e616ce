"""The decode loop and the state it keeps: the decoder a call runs with (:mod:`.decoder`) and its settings
(:mod:`.settings`), the per-call run and its step (:mod:`.run`), the draft's side (:mod:`.drafter`), one verifier per
mode (:mod:`.dense`, :mod:`.sparse`, :mod:`.exact` with its confirmation schedule in :mod:`.confirm`), the
acceptance rule (:mod:`.sampling`); the rows' tokens and lengths (:mod:`.rows`), the KV cache
(:mod:`.cache`), a model driven one plan at a time (:mod:`.runner`), the ragged batch read as stock reads it
(:mod:`.masks`, :mod:`.processors`, :mod:`.outputs`), what a run keeps for the next (:mod:`.workspace`), its
statistics (:mod:`.stats`) and the hooks benchmarks plug in (:mod:`.hooks`)."""
