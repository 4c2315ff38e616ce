"""What transformers calls: ``patch()`` (:mod:`.patching`, with ``dustin_hf.patches``), the attention function
registered under ``"dustin"`` (:mod:`.attention`), and the hand-over from ``generate()``'s prepared arguments to
the decode loop (:mod:`.assisted`)."""
