"""How the decoding loop runs on a GPU: the per-forward metadata its kernels read (:mod:`.plan`), CUDA graphs of its
fixed-shape forwards (:mod:`.graphs`) over a model's forward as device stages (:mod:`.pipeline`), fused decode ops
(:mod:`.fused`, built from :mod:`.ops`, :mod:`.projections`, :mod:`.rotary`, :mod:`.registry`, and
:mod:`.recognise`'s checks against :mod:`._transformers_reference`), launch settings
(:mod:`.launch`), and the tuning of all of them in one frozen object (:class:`dustin_hf.runtime.tuning.Tuning`).

Nothing here changes what is computed; it changes how many launches it takes and how they are issued.
"""
