"""How the decoding loop runs on a GPU: CUDA graphs of its fixed-shape forwards, fused decode ops, launch settings,
and the tuning of all of them in one frozen object (:class:`dustin_hf.runtime.tuning.Tuning`).

Nothing here changes what is computed; it changes how many launches it takes and how they are issued.
"""
